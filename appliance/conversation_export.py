"""A conversation as one JSON file, to download and import again (here or on another appliance):
its title, its settings, the whole tree of messages (every branch, not only the path shown) with
their pictures (data: URIs), and which leaf was shown. Version 1 of the format:

    {"format": "appliance.conversation", "version": 1, "exported_at": ISO 8601,
     "title": str, "settings": {only the keys the user set},
     "created_at": ISO 8601, "updated_at": ISO 8601,
     "current": the id of the message shown last, or null,
     "messages": [{"id", "parent_id" (null for a first message), "role", "content",
                   "reasoning_content", "tool_calls", "tool_call_id", "timings", "finish_reason",
                   "images", "created_at"}, ...]}        # a parent before its children

`check` reads such a file whole and refuses it (InvalidRequest naming the field) unless its shape
is right: the format and a version this code reads, unique ids, each parent an earlier message,
`current` one of them. The ids in a file only link its messages: an import gets new ones.
The fields' values (title, settings, each message's role, content, pictures) are checked by the
web layer as it checks a conversation it creates (`web/conversations.py`).
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Mapping, Sequence

from .conversation_tree import MESSAGE_FIELDS, message_out
from .errors import InvalidRequest

FORMAT = "appliance.conversation"
VERSION = 1
KEYS = ("format", "version", "exported_at", "title", "settings", "created_at", "updated_at", "current",
        "messages")
MESSAGE_KEYS = ("id", "parent_id", *MESSAGE_FIELDS, "created_at")
MAX_ID = 100


@dataclasses.dataclass(frozen=True)
class Imported:
    """A checked file: messages in file order, each parent given as the index of an earlier one."""
    title: Any
    settings: Any
    messages: tuple[dict[str, Any], ...]   # the MESSAGE_FIELDS of each, as in the file
    parents: tuple[int | None, ...]
    created: tuple[str | None, ...]
    current: int | None


def export_doc(conv: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """The file for a conversation's row (settings as stored) and all its message rows in seq order."""
    return {"format": FORMAT, "version": VERSION, "exported_at": now, "title": conv["title"],
            "settings": conv["settings"], "created_at": conv["created_at"], "updated_at": conv["updated_at"],
            "current": conv["current_leaf"], "messages": [message_out(r) for r in rows]}


def _fail(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"not a conversation this appliance can import: {message}", param=param)


def _time(v: Any, param: str) -> str | None:
    if v is None:
        return None
    try:
        if isinstance(v, str):
            datetime.datetime.fromisoformat(v)
            return v
    except ValueError:
        pass
    raise _fail(f"'{param}' must be an ISO 8601 time or null", param)


def _head(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise _fail("the file must be a JSON object", "format")
    for key in doc:
        if key not in KEYS:
            raise _fail(f"unknown field '{key}'; allowed: {', '.join(KEYS)}", key)
    if doc.get("format") != FORMAT:
        raise _fail(f"'format' must be \"{FORMAT}\"", "format")
    version = doc.get("version")
    if version != VERSION or isinstance(version, bool):
        raise _fail(f"'version' {version!r} is not one this server reads (it reads {VERSION})", "version")
    for key in ("exported_at", "created_at", "updated_at"):
        _time(doc.get(key), key)
    if not isinstance(doc.get("messages"), list):
        raise _fail("'messages' must be a list", "messages")


def check(doc: Any) -> Imported:
    """The file's tree, checked whole; InvalidRequest at the first thing wrong."""
    _head(doc)
    index: dict[str, int] = {}
    messages, parents, created = [], [], []
    for i, m in enumerate(doc["messages"]):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _fail(f"'{where}' must be an object", where)
        for key in m:
            if key not in MESSAGE_KEYS:
                raise _fail(f"unknown field '{where}.{key}'; allowed: {', '.join(MESSAGE_KEYS)}", f"{where}.{key}")
        msg_id, parent = m.get("id"), m.get("parent_id")
        if not isinstance(msg_id, str) or not 1 <= len(msg_id) <= MAX_ID:
            raise _fail(f"'{where}.id' must be a string of 1 to {MAX_ID} characters", f"{where}.id")
        if msg_id in index:
            raise _fail(f"'{where}.id' {msg_id!r} is the id of messages[{index[msg_id]}] too", f"{where}.id")
        if parent is not None and parent not in index:
            raise _fail(f"'{where}.parent_id' must be null or the id of an earlier message; got {parent!r}",
                        f"{where}.parent_id")
        index[msg_id] = i
        parents.append(None if parent is None else index[parent])
        created.append(_time(m.get("created_at"), f"{where}.created_at"))
        messages.append({k: m[k] for k in MESSAGE_FIELDS if k in m})
    current = doc.get("current")
    if current is not None and current not in index:
        raise _fail(f"'current' must be null or the id of one of the messages; got {current!r}", "current")
    return Imported(doc.get("title"), doc.get("settings"), tuple(messages), tuple(parents), tuple(created),
                    None if current is None else index[current])
