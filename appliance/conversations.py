"""The chat page's conversations, kept server-side in one SQLite file written through sqlite-utils,
so that they survive a reload, another browser and a restart.

Schema, built by named migrations that are applied once each and recorded in `_migrations`:

    conversations   id ("conv_" + 24 hex digits), title, settings (JSON: only the keys the user
                    set; the web layer fills in the defaults), created_at, updated_at
    messages        one row per message: (conversation_id, position) is the key, positions run
                    0..n-1; role, content, reasoning_content, tool_calls (JSON), tool_call_id,
                    timings (JSON), finish_reason, images (JSON: a user message's pictures as
                    data: URIs, checked by the web layer), created_at. Deleting a conversation
                    deletes its messages (ON DELETE CASCADE).

Times are UTC ISO 8601 with milliseconds. Durability and concurrency as in `store.py`: WAL
journal, a busy timeout on every connection, every write in one `BEGIN IMMEDIATE` transaction
(a read-modify-write such as a settings merge or truncate-and-append is atomic), and every read
of several rows in one transaction, so it sees one committed state.

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

from .errors import ApplianceError, InvalidRequest, NotFound

BUSY_TIMEOUT_MS = 10_000
DEFAULT_TITLE = "New conversation"
MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "timings",
                  "finish_reason", "images")
_JSON_FIELDS = ("tool_calls", "timings", "images")


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
        """The conversation with its messages in position order; NotFound if there is none."""
        with self._read() as db:
            return _full(db, conv_id)

    def summaries(self, q: str | None = None, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """Conversations without their messages (with n_messages), newest updated_at first;
        `q` keeps those whose title or a message's content contains it, ignoring case."""
        where, args = "", []
        if q:
            pattern = "%" + q.casefold().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = ("WHERE casefold(c.title) LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
                     "WHERE m.conversation_id = c.id AND casefold(m.content) LIKE ? ESCAPE '\\')")
            args = [pattern, pattern]
        sql = (f"SELECT c.*, (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS n_messages "
               f"FROM conversations c {where} ORDER BY c.updated_at DESC, c.rowid DESC LIMIT ? OFFSET ?")
        with self._read() as db:
            return [_summary(r) for r in db.query(sql, [*args, limit, offset])]

    # -- writers ---------------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE, settings: Mapping[str, Any] | None = None,
               messages: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """A new conversation; returns it as `get` would."""
        conv_id, now = new_id(), self._clock()
        row = {"id": conv_id, "title": title, "settings": _dumps(dict(settings or {})),
               "created_at": now, "updated_at": now}
        with self._write() as db:
            db.table("conversations").insert(row)
            _put_messages(db, conv_id, 0, messages, now)
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

    def put_messages(self, conv_id: str, messages: Sequence[Mapping[str, Any]],
                     start: int | None = None) -> dict[str, Any]:
        """Drop the messages at positions >= `start` (None: keep them all) and append `messages`
        after the rest; bumps updated_at. InvalidRequest if `start` is not between 0 and the
        number of messages, and then nothing changes."""
        with self._write() as db:
            _row(db, conv_id)
            count = db.table("messages").count_where("conversation_id = ?", [conv_id])
            start = count if start is None else start
            if not 0 <= start <= count:
                raise InvalidRequest(f"'from' must be between 0 and {count} (the number of messages); "
                                     f"got {start}", param="from")
            now = self._clock()
            _put_messages(db, conv_id, start, messages, now)
            db.table("conversations").update(conv_id, {"updated_at": now})
            return _full(db, conv_id)

    def upsert_message(self, conv_id: str, position: int, message: Mapping[str, Any]) -> None:
        """Write `message` at `position`: replace the message there, or append it when `position`
        is the number of messages (a chat job's reply, written as it grows); bumps updated_at.
        InvalidRequest past the end. The one place a job writes a conversation's messages."""
        with self._write() as db:
            _row(db, conv_id)
            count = db.table("messages").count_where("conversation_id = ?", [conv_id])
            if not 0 <= position <= count:
                raise InvalidRequest(f"message position {position} is past the end ({count})", param="position")
            now = self._clock()
            db.execute("DELETE FROM messages WHERE conversation_id = ? AND position = ?", [conv_id, position])
            _put_messages(db, conv_id, position, [message], now, truncate=False)
            db.table("conversations").update(conv_id, {"updated_at": now})

    def delete(self, conv_id: str) -> None:
        """Delete the conversation and its messages; NotFound if there is none."""
        with self._write() as db:
            _row(db, conv_id)
            db.execute("DELETE FROM conversations WHERE id = ?", [conv_id])

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


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _row(db: sqlite_utils.Database, conv_id: str) -> dict[str, Any]:
    rows = list(db.query("SELECT c.*, (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) "
                         "AS n_messages FROM conversations c WHERE c.id = ?", [conv_id]))
    if not rows:
        raise NotFound(f"no conversation '{conv_id}'", param="id")
    return rows[0]


def _summary(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "title": row["title"], "created_at": row["created_at"],
            "updated_at": row["updated_at"], "n_messages": row["n_messages"],
            "settings": json.loads(row["settings"])}


def _full(db: sqlite_utils.Database, conv_id: str) -> dict[str, Any]:
    conv = _summary(_row(db, conv_id))
    rows = db.query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position", [conv_id])
    conv["messages"] = [_message(r) for r in rows]
    return conv


def _message(row: Mapping[str, Any]) -> dict[str, Any]:
    msg = {k: row[k] for k in MESSAGE_FIELDS}
    for k in _JSON_FIELDS:
        msg[k] = None if msg[k] is None else json.loads(msg[k])
    msg["created_at"] = row["created_at"]
    return msg


def _put_messages(db: sqlite_utils.Database, conv_id: str, start: int,
                  messages: Sequence[Mapping[str, Any]], now: str, truncate: bool = True) -> None:
    if truncate:
        db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", [conv_id, start])
    rows = []
    for i, m in enumerate(messages):
        row = {k: m.get(k) for k in MESSAGE_FIELDS}
        for k in _JSON_FIELDS:
            row[k] = None if row[k] is None else _dumps(row[k])
        rows.append({"conversation_id": conv_id, "position": start + i, **row, "created_at": now})
    if rows:
        db.table("messages").insert_all(rows)
