"""The chat page's conversations, kept server-side in one SQLite file written through sqlite-utils,
so that they survive a reload, another browser and a restart.

Schema, built by named migrations that are applied once each and recorded in `_migrations`:

    conversations   id ("conv_" + 24 hex digits), title, settings (JSON: only the keys the user
                    set; the web layer fills in the defaults), created_at, updated_at,
                    current_leaf (the last message of the path shown; null: none shown)
    messages        a tree (`conversation_tree.py`): one row per message, id ("msg_" + 24 hex
                    digits), conversation_id, parent_id (null for a first message), seq (order
                    of creation in the conversation: siblings are ordered by it), depth (1 for a
                    first message), role, content, reasoning_content, tool_calls (JSON),
                    tool_call_id, timings (JSON), finish_reason, images (JSON: a user message's
                    pictures as data: URIs, checked by the web layer), documents (JSON: a user
                    message's attached files as the page sent them, each {name, kind, pages,
                    tokens, content}: content is the framed text sent to the model; version
                    0004), created_at. Deleting a
                    conversation deletes its messages (ON DELETE CASCADE).

A conversation as read (`get`) is its path shown: the messages from a first one down to the
current leaf, each with its siblings (the other answers to the same parent), so an edited
question or a regenerated answer leaves the old one in place as a sibling. Version 0003 turned
each stored list into a single branch.

Times are UTC ISO 8601 with milliseconds. Durability and concurrency as in `store.py`: WAL
journal, a busy timeout on every connection, every write in one `BEGIN IMMEDIATE` transaction
(a read-modify-write such as a settings merge or a branch added at a position of the path shown
is atomic), and every read of several rows in one transaction, so it sees one committed state.

Threads: the web server calls a store from many waitress threads at once. Each operation opens
its own connection and closes it when done, rather than sharing one connection behind a lock: a
sqlite3 connection and its transaction belong to one thread, readers in WAL mode then run side
by side instead of queueing behind a lock, writers are serialised by SQLite itself (the same way
as a second process on the same file, such as another server), and nothing is shared between
threads but the path. Opening a connection costs tens of microseconds, nothing beside a request.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import sqlite3
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import sqlite_utils

from . import conversation_export as export
from .conversation_tree import (MESSAGE_FIELDS, Shape, check_parent, dumps as _dumps, insert_chain, message_row,
                                migrate_linear, new_message_id, path_messages, require)
from .errors import ApplianceError, InvalidRequest, NotFound

BUSY_TIMEOUT_MS = 10_000
DEFAULT_TITLE = "New conversation"
__all__ = ["ConversationStore", "ConversationsUnavailable", "DEFAULT_TITLE", "MESSAGE_FIELDS"]


class ConversationsUnavailable(ApplianceError):
    """The conversations database cannot be opened or written (permissions, disk, a lock held
    past the busy timeout)."""

    status, type, code = 503, "server_unavailable", "conversations_unavailable"


class _Migrations(sqlite_utils.Migrations):
    migrations_table = "_migrations"


MIGRATIONS = _Migrations("conversations")


@MIGRATIONS(name="0001_conversations_messages")
def _create_tables(db: sqlite_utils.Database) -> None:
    # Spelled out as SQL: sqlite-utils cannot declare ON DELETE CASCADE. Later changes are new
    # migrations.
    db.execute("""CREATE TABLE conversations (
        id TEXT PRIMARY KEY, title TEXT NOT NULL, settings TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL, updated_at TEXT NOT NULL)""")
    db.execute("CREATE INDEX conversations_updated_at ON conversations (updated_at)")
    db.execute("""CREATE TABLE messages (
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
        reasoning_content TEXT, tool_calls TEXT, tool_call_id TEXT, timings TEXT,
        finish_reason TEXT, created_at TEXT NOT NULL,
        PRIMARY KEY (conversation_id, position))""")


@MIGRATIONS(name="0002_message_images")
def _add_images(db: sqlite_utils.Database) -> None:
    db.execute("ALTER TABLE messages ADD COLUMN images TEXT")


@MIGRATIONS(name="0003_message_tree")
def _to_tree(db: sqlite_utils.Database) -> None:
    migrate_linear(db)


@MIGRATIONS(name="0004_message_documents")
def _add_documents(db: sqlite_utils.Database) -> None:
    db.execute("ALTER TABLE messages ADD COLUMN documents TEXT")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def new_id() -> str:
    return "conv_" + secrets.token_hex(12)


class ConversationStore:
    """Conversations and their messages in one SQLite file; open with `ConversationStore.open`.
    Safe to share between threads (see the module's docstring). Values are not validated here
    beyond what the schema enforces: the web layer checks requests before they reach it."""

    def __init__(self, path: Path, clock: Callable[[], str] = _now) -> None:
        self.path = path
        self._clock = clock

    @classmethod
    def open(cls, path: str | Path, clock: Callable[[], str] = _now) -> ConversationStore:
        """Open (creating the file and its directory if needed) and bring the schema up to date."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConversationsUnavailable(f"cannot create the directory of the conversations database "
                                           f"{path}: {e}") from None
        store = cls(path, clock)
        with store._connect() as db:
            db.enable_wal()  # persistent in the file: once is enough
            if MIGRATIONS.pending(db):  # checked again under the write lock by apply()
                with _transaction(db, "IMMEDIATE"):
                    MIGRATIONS.apply(db)
        return store

    # -- readers ---------------------------------------------------------------------------

    def get(self, conv_id: str) -> dict[str, Any]:
        """The conversation with its path shown; NotFound if there is none."""
        with self._read() as db:
            return _full(db, conv_id)

    def summaries(self, q: str | None = None, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """Conversations without their messages (with n_messages: the path shown's length),
        newest updated_at first; `q` keeps those whose title or a message's content (in any
        branch) contains it, ignoring case."""
        where, args = "", []
        if q:
            pattern = "%" + q.casefold().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = ("WHERE casefold(c.title) LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
                     "WHERE m.conversation_id = c.id AND casefold(m.content) LIKE ? ESCAPE '\\')")
            args = [pattern, pattern]
        sql = f"SELECT {_COLUMNS} FROM conversations c {where} ORDER BY c.updated_at DESC, c.rowid DESC LIMIT ? OFFSET ?"
        with self._read() as db:
            return [_summary(r) for r in db.query(sql, [*args, limit, offset])]

    def export(self, conv_id: str) -> dict[str, Any]:
        """The conversation as a file to download: its whole tree (`conversation_export.py`)."""
        with self._read() as db:
            conv = _row(db, conv_id)
            rows = list(db.query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq", [conv_id]))
            return export.export_doc({**conv, "settings": json.loads(conv["settings"])}, rows, self._clock())

    # -- writers ---------------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE, settings: Mapping[str, Any] | None = None,
               messages: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """A new conversation, its messages one branch; returns it as `get` would."""
        conv_id, now = new_id(), self._clock()
        row = {"id": conv_id, "title": title, "settings": _dumps(dict(settings or {})),
               "created_at": now, "updated_at": now}
        with self._write() as db:
            db.table("conversations").insert(row)
            leaf = insert_chain(db, conv_id, Shape([]), None, messages, now)
            db.table("conversations").update(conv_id, {"current_leaf": leaf})
            return _full(db, conv_id)

    def update(self, conv_id: str, title: str | None = None,
               settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Set the title (None: unchanged) and merge `settings` key by key (a key set to None is
        removed, so it reads as its default); bumps updated_at."""
        with self._write() as db:
            current = _summary(_row(db, conv_id))
            merged = {**current["settings"], **(settings or {})}
            changes = {"settings": _dumps({k: v for k, v in merged.items() if v is not None}),
                       "updated_at": self._clock()}
            if title is not None:
                changes["title"] = title
            db.table("conversations").update(conv_id, changes)
            return _full(db, conv_id)

    def add_messages(self, conv_id: str, parent: str | None, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Add `messages` one under the other below the message `parent` (None: as a first
        message), beside that parent's other children, which stay; the last one added becomes
        the current leaf (with none, `parent` does). Bumps updated_at. Returns the conversation,
        whose path ends with the messages added. InvalidRequest if `parent` is not one of its
        messages, and then nothing changes."""
        with self._write() as db:
            _row(db, conv_id)
            shape = Shape.read(db, conv_id)
            check_parent(shape, conv_id, parent)
            return self._append(db, conv_id, shape, parent, messages)

    def put_messages(self, conv_id: str, messages: Sequence[Mapping[str, Any]],
                     start: int | None = None) -> dict[str, Any]:
        """Add `messages` to the path shown at position `start` (None: at its end): under the
        message before `start`, as a new branch beside the one that was there, which is kept.
        InvalidRequest if `start` is not between 0 and the path's length, and then nothing changes."""
        with self._write() as db:
            conv = _row(db, conv_id)
            shape = Shape.read(db, conv_id)
            path = shape.path(conv["current_leaf"])
            start = len(path) if start is None else start
            if not 0 <= start <= len(path):
                raise InvalidRequest(f"'from' must be between 0 and {len(path)} (the number of messages); "
                                     f"got {start}", param="from")
            return self._append(db, conv_id, shape, path[start - 1] if start else None, messages)

    def update_message(self, conv_id: str, msg_id: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Set some of a message's fields (MESSAGE_FIELDS; others are left as they are), e.g. a
        reply as it grows or once it is continued; bumps updated_at. NotFound if there is no
        such message in the conversation."""
        with self._write() as db:
            _row(db, conv_id)
            require(Shape.read(db, conv_id), conv_id, msg_id, "message_id")
            row = {k: v for k, v in message_row(changes).items() if k in changes}
            if row:
                db.table("messages").update(msg_id, row)
            db.table("conversations").update(conv_id, {"updated_at": self._clock()})
            return _full(db, conv_id)

    def select(self, conv_id: str, msg_id: str) -> dict[str, Any]:
        """Show the branch through `msg_id`: the current leaf becomes its latest leaf (the most
        recently added message under it with no children). NotFound if it is not one of the
        conversation's messages. updated_at is left alone: moving between branches changes nothing."""
        with self._write() as db:
            _row(db, conv_id)
            shape = Shape.read(db, conv_id)
            require(shape, conv_id, msg_id, "message_id")
            db.table("conversations").update(conv_id, {"current_leaf": shape.latest_leaf(msg_id)})
            return _full(db, conv_id)

    def import_conversation(self, doc: export.Imported, title: str, settings: Mapping[str, Any]) -> dict[str, Any]:
        """A new conversation from a checked file (`conversation_export.check`; its title and
        settings checked by the caller), every branch of it, under new ids."""
        conv_id, now = new_id(), self._clock()
        ids = [new_message_id() for _ in doc.messages]
        depth: list[int] = []
        rows = []
        for i, m in enumerate(doc.messages):
            parent = doc.parents[i]
            depth.append(1 if parent is None else depth[parent] + 1)
            rows.append({"id": ids[i], "conversation_id": conv_id, "parent_id": None if parent is None else ids[parent],
                         "seq": i, "depth": depth[i], **message_row(m), "created_at": doc.created[i] or now})
        with self._write() as db:
            db.table("conversations").insert({"id": conv_id, "title": title, "settings": _dumps(dict(settings)),
                                              "created_at": now, "updated_at": now})
            if rows:
                db.table("messages").insert_all(rows)
            shape = Shape(rows)
            leaf = None if doc.current is None else shape.latest_leaf(ids[doc.current])
            db.table("conversations").update(conv_id, {"current_leaf": leaf})
            return _full(db, conv_id)

    def upsert_message(self, conv_id: str, position: int, message: Mapping[str, Any]) -> None:
        """Write `message` at `position` of the path shown: replace the message there, or add it
        under the path's last message when `position` is the path's length (a chat job's reply,
        written as it grows); bumps updated_at. InvalidRequest past the end. The one place a job
        writes a conversation's messages (a regenerated reply is first cut off the path with
        `put_messages(conv_id, [], position)`, which keeps the old branch)."""
        with self._write() as db:
            conv = _row(db, conv_id)
            shape = Shape.read(db, conv_id)
            path = shape.path(conv["current_leaf"])
            if not 0 <= position <= len(path):
                raise InvalidRequest(f"message position {position} is past the end ({len(path)})", param="position")
            if position == len(path):
                self._append(db, conv_id, shape, path[-1] if path else None, [message])
                return
            db.table("messages").update(path[position], message_row(message))
            db.table("conversations").update(conv_id, {"updated_at": self._clock()})

    def delete(self, conv_id: str) -> None:
        """Delete the conversation and its messages; NotFound if there is none."""
        with self._write() as db:
            _row(db, conv_id)
            db.execute("DELETE FROM conversations WHERE id = ?", [conv_id])

    def _append(self, db: sqlite_utils.Database, conv_id: str, shape: Shape, parent: str | None,
                messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        now = self._clock()
        leaf = insert_chain(db, conv_id, shape, parent, messages, now)
        db.table("conversations").update(conv_id, {"current_leaf": leaf, "updated_at": now})
        return _full(db, conv_id)

    # -- internals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite_utils.Database]:
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as e:
            raise ConversationsUnavailable(f"cannot open the conversations database {self.path}: {e}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys=ON")  # per connection: the cascade needs it
            conn.create_function("casefold", 1, _casefold, deterministic=True)
            yield sqlite_utils.Database(conn, execute_plugins=False)
        except sqlite3.DatabaseError as e:  # locked past the timeout, read-only, disk full, not a database
            raise ConversationsUnavailable(f"the conversations database {self.path} failed: {e}") from None
        finally:
            conn.close()

    def now(self) -> str:
        """The store's clock (UTC ISO 8601, milliseconds), for a store kept beside this one."""
        return self._clock()

    def reading(self) -> contextlib.AbstractContextManager[sqlite_utils.Database]:
        """One read transaction on the file, for a store kept beside this one (chat_jobs.py)."""
        return self._read()

    def writing(self) -> contextlib.AbstractContextManager[sqlite_utils.Database]:
        """One `BEGIN IMMEDIATE` write transaction on the file, for a store kept beside this one."""
        return self._write()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        with self._connect() as db, _transaction(db, "DEFERRED"):
            yield db

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        with self._connect() as db, _transaction(db, "IMMEDIATE"):
            yield db


@contextlib.contextmanager
def _transaction(db: sqlite_utils.Database, kind: str) -> Iterator[None]:
    """One transaction. IMMEDIATE takes the write lock up front, waiting for another writer up to
    the busy timeout, so a transaction never fails half-way on a lock upgrade; DEFERRED (for
    reads) sees one snapshot. sqlite-utils' own atomic blocks nest inside as savepoints."""
    db.execute(f"BEGIN {kind}")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        db.rollback()
        raise


def _casefold(text: str | None) -> str | None:
    return text.casefold() if isinstance(text, str) else text


_COLUMNS = ("c.*, coalesce((SELECT m.depth FROM messages m WHERE m.id = c.current_leaf), 0) AS n_messages")


def _row(db: sqlite_utils.Database, conv_id: str) -> dict[str, Any]:
    rows = list(db.query(f"SELECT {_COLUMNS} FROM conversations c WHERE c.id = ?", [conv_id]))
    if not rows:
        raise NotFound(f"no conversation '{conv_id}'", param="id")
    return rows[0]


def _summary(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "title": row["title"], "created_at": row["created_at"],
            "updated_at": row["updated_at"], "n_messages": row["n_messages"],
            "settings": json.loads(row["settings"])}


def _full(db: sqlite_utils.Database, conv_id: str) -> dict[str, Any]:
    row = _row(db, conv_id)
    conv = _summary(row)
    conv["messages"] = path_messages(db, Shape.read(db, conv_id), row["current_leaf"])
    return conv
