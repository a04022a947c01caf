"""A conversation's messages as a tree: each message has a parent (None for a first message), and
the conversation remembers its current leaf, whose path from the root is what the page shows and
what is sent to the model. Editing a question or regenerating an answer adds a sibling; the old
branch stays, and selecting a message moves the current leaf to that message's latest leaf.

Queries over one conversation's rows, run inside the store's transactions (`conversations.py`
owns the connections). A conversation is small (hundreds of messages), so its shape (id,
parent_id, seq: a few bytes a message) is read whole and walked in Python; only the path's rows
are read with their contents (pictures make those heavy).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Iterable, Mapping, Sequence

import sqlite_utils

from .errors import InvalidRequest, NotFound

MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "timings",
                  "finish_reason", "images", "documents")
JSON_FIELDS = ("tool_calls", "timings", "images", "documents")


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


class Shape:
    """One conversation's tree without contents: parent and creation order of each message."""

    def __init__(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.parent: dict[str, str | None] = {}
        self.seq: dict[str, int] = {}
        self.children: dict[str | None, list[str]] = {}
        for r in sorted(rows, key=lambda r: r["seq"]):
            self.parent[r["id"]] = r["parent_id"]
            self.seq[r["id"]] = r["seq"]
            self.children.setdefault(r["parent_id"], []).append(r["id"])

    @classmethod
    def read(cls, db: sqlite_utils.Database, conv_id: str) -> Shape:
        return cls(db.query("SELECT id, parent_id, seq FROM messages WHERE conversation_id = ?", [conv_id]))

    def path(self, leaf: str | None) -> list[str]:
        """The ids from the root down to `leaf` (none for None)."""
        out = []
        while leaf is not None:
            out.append(leaf)
            leaf = self.parent[leaf]
        return out[::-1]

    def siblings(self, msg_id: str) -> list[str]:
        """`msg_id` and the other children of its parent, oldest first."""
        return self.children[self.parent[msg_id]]

    def latest_leaf(self, msg_id: str) -> str:
        """The most recently added message with no children in the subtree of `msg_id`."""
        leaves, stack = [], [msg_id]
        while stack:
            node = stack.pop()
            kids = self.children.get(node)
            if kids:
                stack.extend(kids)
            else:
                leaves.append(node)
        return max(leaves, key=self.seq.__getitem__)

    def next_seq(self) -> int:
        return max(self.seq.values(), default=-1) + 1


def require(shape: Shape, conv_id: str, msg_id: str, param: str) -> None:
    if msg_id not in shape.parent:
        raise NotFound(f"no message '{msg_id}' in conversation '{conv_id}'", param=param)


def message_out(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stored row as the API shows a message (without its place among siblings)."""
    msg: dict[str, Any] = {"id": row["id"], "parent_id": row["parent_id"]}
    msg.update({k: row[k] for k in MESSAGE_FIELDS})
    for k in JSON_FIELDS:
        msg[k] = None if msg[k] is None else json.loads(msg[k])
    msg["created_at"] = row["created_at"]
    return msg


def rows_by_id(db: sqlite_utils.Database, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    if not ids:
        return {}
    marks = ",".join("?" * len(ids))
    return {r["id"]: r for r in db.query(f"SELECT * FROM messages WHERE id IN ({marks})", list(ids))}


def path_messages(db: sqlite_utils.Database, shape: Shape, leaf: str | None) -> list[dict[str, Any]]:
    """The path shown, each message with its siblings' ids, its index among them and their count."""
    ids = shape.path(leaf)
    rows = rows_by_id(db, ids)
    out = []
    for msg_id in ids:
        sibs = shape.siblings(msg_id)
        out.append({**message_out(rows[msg_id]), "siblings": list(sibs), "sibling_index": sibs.index(msg_id),
                    "n_siblings": len(sibs)})
    return out


def message_row(m: Mapping[str, Any]) -> dict[str, Any]:
    row = {k: m.get(k) for k in MESSAGE_FIELDS}
    for k in JSON_FIELDS:
        row[k] = None if row[k] is None else dumps(row[k])
    return row


def insert_chain(db: sqlite_utils.Database, conv_id: str, shape: Shape, parent: str | None,
                 messages: Sequence[Mapping[str, Any]], now: str) -> str | None:
    """Add `messages` one under the other below `parent`; returns the last one's id (the new
    leaf), or `parent` when there are none."""
    seq, depth = shape.next_seq(), len(shape.path(parent))
    rows = []
    for m in messages:
        msg_id = new_message_id()
        rows.append({"id": msg_id, "conversation_id": conv_id, "parent_id": parent, "seq": seq,
                     "depth": depth + 1, **message_row(m), "created_at": now})
        parent, seq, depth = msg_id, seq + 1, depth + 1
    if rows:
        db.table("messages").insert_all(rows)
    return parent


def migrate_linear(db: sqlite_utils.Database) -> None:
    """From one list of messages per conversation (key: conversation, position) to the tree:
    each message's parent is the one before it, and the current leaf is the last one."""
    db.execute("ALTER TABLE messages RENAME TO messages_linear")
    db.execute("""CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        parent_id TEXT REFERENCES messages (id) ON DELETE CASCADE,
        seq INTEGER NOT NULL, depth INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
        reasoning_content TEXT, tool_calls TEXT, tool_call_id TEXT, timings TEXT,
        finish_reason TEXT, images TEXT, created_at TEXT NOT NULL)""")
    db.execute("CREATE INDEX messages_conversation ON messages (conversation_id, parent_id)")
    db.execute("ALTER TABLE conversations ADD COLUMN current_leaf TEXT")
    last: dict[str, str] = {}
    for r in db.query("SELECT * FROM messages_linear ORDER BY conversation_id, position"):
        conv_id, msg_id = r["conversation_id"], new_message_id()
        db.table("messages").insert({"id": msg_id, "conversation_id": conv_id, "parent_id": last.get(conv_id),
                                     "seq": r["position"], "depth": r["position"] + 1,
                                     **{k: r[k] for k in MESSAGE_FIELDS if k in r}, "created_at": r["created_at"]})
        last[conv_id] = msg_id
    for conv_id, leaf in last.items():
        db.execute("UPDATE conversations SET current_leaf = ? WHERE id = ?", [leaf, conv_id])
    db.execute("DROP TABLE messages_linear")


def check_parent(shape: Shape, conv_id: str, parent: str | None) -> None:
    if parent is not None and parent not in shape.parent:
        raise InvalidRequest(f"no message '{parent}' in conversation '{conv_id}' to add under", param="parent")
