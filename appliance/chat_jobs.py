"""Chat jobs: a chat turn the server generates on its own, recorded in the conversations file
(conversations.db) beside the conversation it writes, so that its state outlives the tab that
started it and the server process that ran it.

Schema, by its own named migrations (recorded in `_migrations` under the set "chat_jobs"):

    chat_jobs   id ("job_" + 24 hex digits), conversation_id (ON DELETE CASCADE), state,
                position (where the job's first message goes), current (the position of the
                message it writes now), steps (tool rounds done), pending (JSON: the tool calls
                of the current reply and each one's decision), error, created_at, updated_at

States: "running" (generating, or running tools), "waiting" (tool calls wait for the person's
decision), and the ends: "done", "stopped" (by the stop route), "error", "cut_off" (the server
stopped while it was running or waiting: found so by `sweep` at the next start). At most one job
of a conversation is running or waiting at once: `create` checks it in the same write
transaction that inserts the row, so two starts at once cannot both succeed.

The events a job streams are kept in memory by the web layer (web/chat_job_runner.py); what is
stored here is what a page needs after a reload or a restart: the state and the pending calls.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Iterable

import sqlite_utils

from .conversations import ConversationStore
from .errors import Conflict, NotFound

ACTIVE = ("running", "waiting")
ENDED = ("done", "stopped", "error", "cut_off")
FIELDS = ("state", "current", "steps", "pending", "error")

class _Migrations(sqlite_utils.Migrations):
    migrations_table = "_migrations"   # the conversation store's table: one record of the file's schema


MIGRATIONS = _Migrations("chat_jobs")


@MIGRATIONS(name="0001_chat_jobs")
def _create_table(db: sqlite_utils.Database) -> None:
    db.execute("""CREATE TABLE chat_jobs (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        state TEXT NOT NULL, position INTEGER NOT NULL, current INTEGER NOT NULL,
        steps INTEGER NOT NULL DEFAULT 0, pending TEXT NOT NULL DEFAULT '[]', error TEXT,
        created_at TEXT NOT NULL, updated_at TEXT NOT NULL)""")
    db.execute("CREATE INDEX chat_jobs_conversation ON chat_jobs (conversation_id, created_at)")


class ChatJobStore:
    """The chat_jobs table of a conversations file; open with `ChatJobStore.open(conversations)`.
    Shares the conversation store's connections and their rules (one per operation, WAL, every
    write one IMMEDIATE transaction)."""

    def __init__(self, conversations: ConversationStore) -> None:
        self.conversations = conversations

    @classmethod
    def open(cls, conversations: ConversationStore) -> ChatJobStore:
        with conversations.writing() as db:
            MIGRATIONS.apply(db)
        return cls(conversations)

    def create(self, conv_id: str, position: int) -> dict[str, Any]:
        """A new running job of the conversation whose first message goes at `position`;
        Conflict if one of its jobs is still running or waiting, NotFound if there is no such
        conversation."""
        now = self.conversations.now()
        row = {"id": "job_" + secrets.token_hex(12), "conversation_id": conv_id, "state": "running",
               "position": position, "current": position, "steps": 0, "pending": "[]", "error": None,
               "created_at": now, "updated_at": now}
        with self.conversations.writing() as db:
            if not db.table("conversations").count_where("id = ?", [conv_id]):
                raise NotFound(f"no conversation '{conv_id}'", param="id")
            busy = _rows(db, "conversation_id = ? AND state IN (?, ?)", [conv_id, *ACTIVE])
            if busy:
                raise Conflict(f"the conversation '{conv_id}' has a job {busy[0]['state']} ({busy[0]['id']}): "
                               "stop it or wait for its end", param="conversation_id")
            db.table("chat_jobs").insert(row)
        return _job(row)

    def get(self, job_id: str) -> dict[str, Any]:
        with self.conversations.reading() as db:
            rows = _rows(db, "id = ?", [job_id])
        if not rows:
            raise NotFound(f"no job '{job_id}'", param="job_id")
        return rows[0]

    def latest(self, conv_id: str) -> dict[str, Any] | None:
        """The conversation's most recent job, None if it has had none."""
        with self.conversations.reading() as db:
            rows = _rows(db, "conversation_id = ?", [conv_id], "ORDER BY created_at DESC, rowid DESC LIMIT 1")
        return rows[0] if rows else None

    def update(self, job_id: str, **changes: Any) -> dict[str, Any]:
        """Set some of FIELDS (pending: a list, stored as JSON); returns the job (NotFound: gone)."""
        assert set(changes) <= set(FIELDS), changes
        if "pending" in changes:
            changes["pending"] = json.dumps(changes["pending"], ensure_ascii=False)
        changes["updated_at"] = self.conversations.now()
        with self.conversations.writing() as db:
            db.execute(f"UPDATE chat_jobs SET {', '.join(f'{k} = ?' for k in changes)} WHERE id = ?",
                       [*changes.values(), job_id])
            rows = _rows(db, "id = ?", [job_id])
        if not rows:   # its conversation was deleted (and the job with it)
            raise NotFound(f"no job '{job_id}'", param="job_id")
        return rows[0]

    def delete(self, job_id: str) -> None:
        with self.conversations.writing() as db:
            db.execute("DELETE FROM chat_jobs WHERE id = ?", [job_id])

    def sweep(self) -> list[dict[str, Any]]:
        """At a server's start: every job still running or waiting was cut off by the stop of
        the process that ran it. Marks them so and returns them (the caller marks their messages)."""
        with self.conversations.writing() as db:
            rows = _rows(db, "state IN (?, ?)", list(ACTIVE))
            db.execute("UPDATE chat_jobs SET state = 'cut_off', updated_at = ? WHERE state IN (?, ?)",
                       [self.conversations.now(), *ACTIVE])
        return [{**r, "state": "cut_off"} for r in rows]


def _rows(db: sqlite_utils.Database, where: str, args: Iterable[Any], tail: str = "") -> list[dict[str, Any]]:
    return [_job(r) for r in db.query(f"SELECT * FROM chat_jobs WHERE {where} {tail}", list(args))]


def _job(row: dict[str, Any]) -> dict[str, Any]:
    pending = row["pending"]
    return {"id": row["id"], "object": "chat.job", "conversation_id": row["conversation_id"],
            "state": row["state"], "position": row["position"], "current": row["current"],
            "steps": row["steps"], "pending": json.loads(pending) if isinstance(pending, str) else pending,
            "error": row["error"], "created_at": row["created_at"], "updated_at": row["updated_at"]}
