"""/api/conversations: the chat page's conversations, stored server-side in SQLite
(`appliance/conversations.py`), so they survive a reload, another browser and a restart.

    GET    /api/conversations?q=&limit=&offset=   {"object": "list", "data": [summary...]}
    POST   /api/conversations                     {title?, settings?, messages?} -> 201 conversation
    GET    /api/conversations/<id>                conversation (summary + the path shown)
    PATCH  /api/conversations/<id>                {title?, settings?} -> conversation
    DELETE /api/conversations/<id>                {"id", "object": "conversation.deleted", "deleted": true}
    POST   /api/conversations/<id>/messages       {messages, from? | parent?} -> conversation
    PUT    /api/conversations/<id>/messages/<m>   a message -> conversation (message m replaced)
    POST   /api/conversations/<id>/select         {message_id} -> conversation
    GET    /api/conversations/<id>/export         the file of appliance/conversation_export.py
    POST   /api/conversations/import              that file -> 201 a new conversation

The messages are a tree (appliance/conversation_tree.py); a conversation shows one path of it,
each message with its `siblings` (ids, oldest first), `sibling_index` and `n_siblings`. Adding
messages never deletes: under `parent` (a message id), or at position `from` of the path shown
(under the message before it, beside the one there), or, with neither, at the path's end; what
was added becomes the path shown. `select` shows the branch through a message, down to its
latest leaf.

A request is checked whole before anything is written, so a refused one changes nothing. In a
body, null means the same as absent: the default on create, unchanged on update; inside
"settings" on update, a key set to null goes back to its default.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from flask import Blueprint, current_app, jsonify, request
from flask.blueprints import BlueprintSetupState

from appliance import conversation_export
from appliance.conversations import DEFAULT_TITLE, MESSAGE_FIELDS, ConversationStore
from appliance.errors import InvalidRequest
from appliance.mcp.settings import TOOL_NAME

from . import document_text, images
from .params import CHAT, Param
from .wire import parse_json_body

bp = Blueprint("conversations", __name__)

KEY = "appliance.conversations"
MAX_TITLE = 200
MAX_SYSTEM = 200_000
MAX_MODEL = 1000
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
ROLES = ("system", "user", "assistant", "tool")
DEFAULTS: dict[str, Any] = {"system": "", "temperature": 0.7, "top_p": 1.0, "max_tokens": 1024,
                            "seed": None, "thinking": None, "model": None, "tools": []}
MAX_TOOLS = 128          # tools one conversation may choose (names as /api/tools gives them)


def _setting(name: str, **changes: Any) -> Param:
    """The /v1 declaration of `name` (so a saved setting is one the chat API takes), renamed."""
    return dataclasses.replace(CHAT[name], name=f"settings.{name}", default=None, **changes)


# the settings other than strings (system, model), checked as the chat API checks them
SCALARS = {"temperature": _setting("temperature"), "top_p": _setting("top_p"),
           "max_tokens": _setting("max_tokens", hi=1_000_000), "seed": _setting("seed"),
           "thinking": Param("settings.thinking", "boolean", "think before answering (null: the "
                             "template's default)")}
FROM = Param("from", "integer", "add the messages at this position of the path shown, as a new branch", lo=0)
STRINGS = {"system": (0, MAX_SYSTEM), "model": (1, MAX_MODEL)}
MAX_DOCUMENTS = 16
MAX_DOCUMENT = document_text.MAX_CHARS + 1000     # characters: the text and its framing
DOCUMENT_FIELDS = ("name", "kind", "pages", "tokens", "content")


class _LazyStore:
    """The app's store, opened on first use (not at start: a server whose conversations file
    cannot be opened still serves /v1). A failed open is tried again on the next request."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._store: ConversationStore | None = None

    def get(self) -> ConversationStore:
        with self._lock:
            if self._store is None:
                self._store = ConversationStore.open(self.path)  # ConversationsUnavailable: a 503
            return self._store


@bp.record_once
def _setup(state: BlueprintSetupState) -> None:
    config = state.app.extensions["appliance"].config
    state.app.extensions[KEY] = _LazyStore(config.server.resolved_conversations_db())


def _store() -> ConversationStore:
    return current_app.extensions[KEY].get()


# -- checks --------------------------------------------------------------------------------------

def _body(allowed: tuple[str, ...]) -> dict[str, Any]:
    body = parse_json_body(request.get_data(cache=False))
    _only(body, allowed, "")
    return body


def _only(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise InvalidRequest(f"unknown field '{where}{key}'; allowed: {', '.join(allowed)}",
                                 param=f"{where}{key}")


def _string(v: Any, name: str, lo: int, hi: int, strip: bool = False) -> str:
    if not isinstance(v, str):
        raise InvalidRequest(f"'{name}' must be a string", param=name)
    v = v.strip() if strip else v
    if not lo <= len(v) <= hi:
        raise InvalidRequest(f"'{name}' must be {lo} to {hi} characters{' (spaces stripped)' if strip else ''}; "
                             f"got {len(v)}", param=name)
    return v


def _id(body: dict, name: str) -> str | None:
    v = body.get(name)
    return None if v is None else _string(v, name, 1, 100)


def _title(body: dict) -> str | None:
    v = body.get("title")
    return None if v is None else _string(v, "title", 1, MAX_TITLE, strip=True)


def _settings(body: dict) -> dict[str, Any]:
    """The settings given, checked; None where a key is set to null (its default)."""
    settings = body.get("settings")
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise InvalidRequest("'settings' must be an object", param="settings")
    _only(settings, tuple(DEFAULTS), "settings.")
    out = {}
    for key, v in settings.items():
        if key in SCALARS:
            out[key] = SCALARS[key].read({SCALARS[key].name: v})
        elif key == "tools":
            out[key] = None if v is None else _tool_names(v)
        else:
            out[key] = None if v is None else _string(v, f"settings.{key}", *STRINGS[key])
    return out


def _tool_names(v: Any) -> list[str]:
    """settings.tools: the MCP tools the conversation gives the model, by their /api/tools names
    (a tool whose server is down now keeps its place)."""
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise InvalidRequest(f"'settings.tools' must be a list of at most {MAX_TOOLS} tool names",
                             param="settings.tools")
    for name in v:
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest("'settings.tools' holds tool names as /api/tools gives them: 1 to 64 "
                                 "letters, digits, '_' or '-'", param="settings.tools")
    return list(dict.fromkeys(v))


def _optional(m: dict, key: str, kind: type, what: str, where: str) -> None:
    v = m.get(key)
    if v is not None and not isinstance(v, kind):
        raise InvalidRequest(f"'{where}.{key}' must be {what} or null", param=f"{where}.{key}")


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    _only(m, MESSAGE_FIELDS, f"{where}.")
    if m.get("role") not in ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}; got {m.get('role')!r}",
                             param=f"{where}.role")
    if not isinstance(m.get("content"), str):
        raise InvalidRequest(f"'{where}.content' is required and must be a string", param=f"{where}.content")
    for key in ("reasoning_content", "tool_call_id", "finish_reason"):
        _optional(m, key, str, "a string", where)
    _optional(m, "timings", dict, "an object", where)
    _optional(m, "tool_calls", list, "a list of objects", where)
    _images(m, where)
    _documents(m, where)
    if not all(isinstance(c, dict) for c in m.get("tool_calls") or ()):
        raise InvalidRequest(f"'{where}.tool_calls' must be a list of objects", param=f"{where}.tool_calls")
    return m


def _images(m: dict, where: str) -> None:
    """A user message's pictures: data: URIs, each one the chat API would take (web/images.py),
    so that nothing stored is refused when it is sent."""
    pics = m.get("images")
    if pics is None:
        return
    if not isinstance(pics, list) or not all(isinstance(p, str) for p in pics) or m.get("role") != "user":
        raise InvalidRequest(f"'{where}.images' must be a list of data: URIs, on a user message",
                             param=f"{where}.images")
    found = images.Images()
    for k, url in enumerate(pics):
        if not url.startswith("data:"):        # the store keeps the picture itself, never a link
            raise InvalidRequest(f"'{where}.images[{k}]' must be a data: URI", param=f"{where}.images[{k}]")
        found.add(images.data_uri(url, f"{where}.images[{k}]"), f"{where}.images[{k}]")


def _documents(m: dict, where: str) -> None:
    """A user message's attached files as /api/documents answered them: each a name, its kind,
    pages (a PDF's, else null), its token count and the framed content the page sends."""
    docs = m.get("documents")
    if docs is None:
        return
    if not isinstance(docs, list) or len(docs) > MAX_DOCUMENTS or m.get("role") != "user":
        raise InvalidRequest(f"'{where}.documents' must be a list of at most {MAX_DOCUMENTS} documents, "
                             "on a user message", param=f"{where}.documents")
    for k, d in enumerate(docs):
        at = f"{where}.documents[{k}]"
        if not isinstance(d, dict):
            raise InvalidRequest(f"'{at}' must be an object", param=at)
        _only(d, DOCUMENT_FIELDS, f"{at}.")
        _string(d.get("name"), f"{at}.name", 1, document_text.MAX_NAME)
        _string(d.get("content"), f"{at}.content", 0, MAX_DOCUMENT)
        if d.get("kind") not in ("pdf", "text"):
            raise InvalidRequest(f"'{at}.kind' must be 'pdf' or 'text'", param=f"{at}.kind")
        for key in ("pages", "tokens"):
            v = d.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidRequest(f"'{at}.{key}' must be a count or null", param=f"{at}.{key}")


def _messages(body: dict, required: bool) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None and not required:
        return []
    if not isinstance(msgs, list):
        raise InvalidRequest("'messages' must be a list of messages", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(msgs)]


def _int_arg(name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise InvalidRequest(f"'{name}' must be an integer; got {raw!r}", param=name) from None
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}; got {v}", param=name)
    return v


# -- responses -----------------------------------------------------------------------------------

def _summary(conv: dict[str, Any]) -> dict[str, Any]:
    return {"id": conv["id"], "object": "conversation", "title": conv["title"],
            "created_at": conv["created_at"], "updated_at": conv["updated_at"],
            "n_messages": conv["n_messages"], "settings": {**DEFAULTS, **conv["settings"]}}


def _full(conv: dict[str, Any]):
    return jsonify({**_summary(conv), "messages": conv["messages"]})


# -- routes --------------------------------------------------------------------------------------

@bp.get("/api/conversations")
def list_conversations():
    q = request.args.get("q") or None
    limit = _int_arg("limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    offset = _int_arg("offset", 0, 0, 2**62)
    rows = _store().summaries(q, limit, offset)
    return jsonify({"object": "list", "data": [_summary(r) for r in rows]})


@bp.post("/api/conversations")
def create_conversation():
    body = _body(("title", "settings", "messages"))
    title, messages = _title(body) or DEFAULT_TITLE, _messages(body, required=False)
    settings = {k: v for k, v in _settings(body).items() if v is not None}
    return _full(_store().create(title, settings, messages)), 201


@bp.get("/api/conversations/<conv_id>")
def get_conversation(conv_id: str):
    return _full(_store().get(conv_id))


@bp.patch("/api/conversations/<conv_id>")
def update_conversation(conv_id: str):
    body = _body(("title", "settings"))
    title, settings = _title(body), _settings(body)
    return _full(_store().update(conv_id, title, settings))


@bp.delete("/api/conversations/<conv_id>")
def delete_conversation(conv_id: str):
    _store().delete(conv_id)
    return jsonify({"id": conv_id, "object": "conversation.deleted", "deleted": True})


@bp.post("/api/conversations/<conv_id>/messages")
def put_messages(conv_id: str):
    body = _body(("messages", "from", "parent"))
    messages, start, parent = _messages(body, required=True), FROM.read(body), _id(body, "parent")
    if parent is not None:
        if start is not None:
            raise InvalidRequest("give 'from' or 'parent', not both", param="parent")
        return _full(_store().add_messages(conv_id, parent, messages))
    return _full(_store().put_messages(conv_id, messages, start))  # the upper bound of from: in the store


@bp.put("/api/conversations/<conv_id>/messages/<msg_id>")
def replace_message(conv_id: str, msg_id: str):
    m = _message(parse_json_body(request.get_data(cache=False)), "message")
    return _full(_store().update_message(conv_id, msg_id, {k: m.get(k) for k in MESSAGE_FIELDS}))


@bp.post("/api/conversations/<conv_id>/select")
def select_branch(conv_id: str):
    body = _body(("message_id",))
    msg_id = _id(body, "message_id")
    if msg_id is None:
        raise InvalidRequest("'message_id' is required", param="message_id")
    return _full(_store().select(conv_id, msg_id))


@bp.get("/api/conversations/<conv_id>/export")
def export_conversation(conv_id: str):
    doc = _store().export(conv_id)
    resp = jsonify(doc)
    name = "".join(c if c.isalnum() or c in "-_ " else "_" for c in doc["title"]).strip() or "conversation"
    resp.headers["Content-Disposition"] = f'attachment; filename="{name[:80]}.json"'
    return resp


@bp.post("/api/conversations/import")
def import_conversation():
    """The whole file is checked (its shape, then each value as a create checks it) before
    anything is written."""
    doc = parse_json_body(request.get_data(cache=False))
    tree = conversation_export.check(doc)
    title = _title(doc) or DEFAULT_TITLE
    settings = {k: v for k, v in _settings(doc).items() if v is not None}
    for i, m in enumerate(tree.messages):
        _message(m, f"messages[{i}]")
    return _full(_store().import_conversation(tree, title, settings)), 201
