"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/<id>`), as the
`openai` SDK's `client.responses` and the agents built on it speak it, translated to and from
the OpenAI chat request that the rest of the server serves: one validation (`wire.parse_chat`),
one engine, the same prompt cache, speculation, timings and limits.

Request: `input` as a string or a list of items: messages (user, assistant, system, developer;
content a string or input_text/output_text parts), `function_call`, `custom_tool_call` and their
outputs of earlier turns, `reasoning` items (accepted and not re-sent: templates drop earlier
reasoning); `instructions` (a system message, not carried over by `previous_response_id`),
`tools` (function, namespace and custom tools; hosted ones left out: web/openai_responses_tools.py),
`tool_choice`, `parallel_tool_calls`, `text.format` (json_schema, json_object,
text: the same structured output), `temperature`, `top_p`, `max_output_tokens`,
`reasoning.effort` (the template's thinking switch: none and minimal turn it off, low to max
turn it on; low, medium and high also reach templates that read `reasoning_effort`),
`previous_response_id`, `store`, `stream`, and the server's own knobs its chat endpoint takes
(EXTENSIONS). Fields that say how OpenAI's service runs a request are accepted without effect
(ACCEPTED); what this server cannot do (background, conversations, prompt templates, logprobs) is
refused by name, as is any unknown field.

Reply: the Response object (web/openai_responses_writer.py: output items in the order the
model produced them, and the stream's events). Errors have OpenAI's shape (the app's handler).
Replies are kept, unless `store` is false, in a per-app LRU of the last STORE_SIZE responses, in
memory until the server stops: `previous_response_id` continues one, GET and DELETE read and
drop one; an id that is not there (never stored, deleted, evicted) is a 400 naming
previous_response_id.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from flask import Blueprint, current_app, jsonify

from appliance.engine.types import Delta, Done
from appliance.errors import InvalidRequest, NotFound

from . import images, serving
from . import openai_responses_tools as tools
from .reasoning import reasoning_kwargs
from .openai_responses_writer import ResponseWriter, SseWriter, new_response

bp = Blueprint("openai_responses", __name__)

STORE_SIZE = 256   # responses kept for previous_response_id: a conversation is shared, not copied
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}   # part type -> its text field
TRANSLATED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "temperature",
              "top_p", "max_output_tokens", "reasoning", "stream", "store", "previous_response_id", "truncation"}
# how OpenAI's service runs, caches, moderates or bills a request: accepted, no effect here
ACCEPTED = {"include", "metadata", "client_metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "service_tier", "max_tool_calls", "context_management", "stream_options",
            "moderation", "image", "access_programs", "background_options"}
# the server's own sampling and cache knobs, as its chat endpoint takes them
EXTENSIONS = ("seed", "top_k", "min_p", "stop", "ignore_eos", "cache_prompt", "cache_pin", "speculate", "keep_alive")
# taken only when empty or off: what this server cannot do
REFUSED = {"background": "background responses", "conversation": "conversations (send previous_response_id)",
           "prompt": "prompt templates", "top_logprobs": "logprobs"}


# -- the store ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    conversation: list[dict[str, Any]]   # chat messages up to this response's output, instructions left out
    response: dict[str, Any]             # the Response object, as GET answers it


class ResponseStore:
    """The last `size` stored responses, the least recently used evicted first."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()   # waitress serves on many threads

    def put(self, rid: str, stored: Stored) -> None:
        with self._lock:
            self._items[rid] = stored
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


@bp.record_once
def _per_app_store(state) -> None:
    state.app.extensions["openai_responses"] = ResponseStore()


def _store() -> ResponseStore:
    return current_app.extensions["openai_responses"]


def history(store: ResponseStore, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation `previous_response_id` continues (none without one)."""
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    serving.need(isinstance(prev, str), "'previous_response_id' must be a string", "previous_response_id")
    stored = store.get(prev)
    if stored is None:
        raise InvalidRequest(f"previous response '{prev}' is not stored on this server: it never was (store: false, "
                             f"or another server), was deleted, or was evicted (the last {store.size} are kept, "
                             "in memory until the server stops)", param="previous_response_id",
                             code="previous_response_not_found")
    return stored.conversation


# -- request: Responses -> OpenAI chat ----------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (an assistant's refusal counts as its text)."""
    if isinstance(content, str):
        return content
    serving.need(isinstance(content, list), f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        serving.need(kind in TEXT_PARTS, f"{where}[{j}]: {kind!r} parts are not supported (this server takes "
                 "input_text, output_text and input_image)", f"{where}[{j}].type")
        text = part.get(TEXT_PARTS[kind])
        serving.need(isinstance(text, str), f"{where}[{j}].{TEXT_PARTS[kind]} must be a string", f"{where}[{j}]")
        out.append(text)
    return "".join(out)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or OpenAI's parts when it has input_image parts (a data: URI
    each: web/images.py reads them)."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                              for p in content)):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            serving.need(isinstance(url, str), f"{where}[{j}].image_url must be a data: URI (file_id is not "
                         "supported)", f"{where}[{j}].image_url")
            parts.append(images.image_url_part(url))
        else:
            parts.append({"type": "text", "text": _text([part], f"{where}[{j}]")})
    return parts


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function call item (or a custom tool's: its input as the one argument) as a tool call."""
    custom = item.get("type") == "custom_tool_call"
    body = "input" if custom else "arguments"
    serving.need(all(isinstance(item.get(k), str) for k in ("call_id", "name", body)),
             f"{where}: a {item.get('type')} item needs call_id, name and {body} (strings)", where)
    arguments = json.dumps({"input": item["input"]}) if custom else item["arguments"]
    return {"id": item["call_id"], "type": "function",
            "function": {"name": tools.flat(item.get("namespace"), item["name"]), "arguments": arguments}}


def messages(items: list[Any], where: str) -> list[dict[str, Any]]:
    """Input (or output) items as chat messages: function calls join the assistant turn before
    them, each output answers its call, reasoning is left out."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        serving.need(isinstance(item, dict), f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            serving.need(item.get("role") in ROLES, f"{at}.role must be one of {', '.join(ROLES)}", f"{at}.role")
            out.append({"role": item["role"], "content": _content(item.get("content"), f"{at}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(item, at))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            serving.need(isinstance(item.get("call_id"), str), f"{at}.call_id must be a string", f"{at}.call_id")
            output = _text(item.get("output"), f"{at}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            serving.need(kind == "reasoning", f"{at}: {kind!r} items are not supported (message, function_call, "
                     "custom_tool_call, their outputs and reasoning are)", f"{at}.type")
    return out


def _input(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    serving.need(isinstance(items, list) and len(items) > 0, "'input' is required: a string or a non-empty list of items",
             "input")
    return messages(items, "input")


def _text_format(body: dict[str, Any], oai: dict[str, Any]) -> None:
    """text.format: the same structured output as the chat request's response_format."""
    text = body.get("text")
    if text is None:
        return
    unknown = sorted(set(text) - {"format", "verbosity"}) if isinstance(text, dict) else []
    serving.need(isinstance(text, dict) and not unknown, "'text' must be an object with 'format' (and 'verbosity')",
             f"text.{unknown[0]}" if unknown else "text")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    serving.need(kind in ("text", "json_object", "json_schema"), "text.format.type must be text, json_object or json_schema",
             "text.format.type")
    if kind == "json_object":
        oai["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        serving.need(isinstance(fmt.get("schema"), dict), "text.format.schema (a JSON schema object) is required",
                 "text.format.schema")
        js = {"name": fmt.get("name", "output"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            js["strict"] = fmt["strict"]
        oai["response_format"] = {"type": "json_schema", "json_schema": js}


def _reasoning(body: dict[str, Any], oai: dict[str, Any]) -> None:
    reasoning = body.get("reasoning")
    serving.need(reasoning is None or isinstance(reasoning, dict), "'reasoning' must be an object", "reasoning")
    kwargs = reasoning_kwargs((reasoning or {}).get("effort"), "reasoning.effort")
    if kwargs:
        oai["chat_template_kwargs"] = kwargs


def _checked(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - TRANSLATED - ACCEPTED - set(EXTENSIONS) - set(REFUSED))
    serving.need(not unknown, f"unknown field(s): {', '.join(unknown)}", unknown[0] if unknown else "")
    for name, what in REFUSED.items():
        serving.need(body.get(name) in (None, False, 0), f"'{name}' ({what}) is not supported by this server", name)
    serving.need(body.get("truncation") in (None, "auto", "disabled"), "'truncation' must be auto or disabled", "truncation")
    serving.need(body.get("store") is None or isinstance(body["store"], bool), "'store' must be true or false", "store")
    serving.need(body.get("metadata") is None or isinstance(body["metadata"], dict), "'metadata' must be an object",
             "metadata")
    serving.need(body.get("instructions") is None or isinstance(body["instructions"], str),
             "'instructions' must be a string", "instructions")
    n = body.get("max_output_tokens")
    serving.need(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
             "'max_output_tokens' must be a positive integer", "max_output_tokens")
    serving.need(body.get("stream") is None or isinstance(body["stream"], bool), "'stream' must be true or false", "stream")


def to_openai(body: dict[str, Any], model: str, earlier: Sequence[dict[str, Any]] = (),
              offered: tools.Offered | None = None) -> dict[str, Any]:
    """The OpenAI chat body that serves this Responses request, after the `earlier` conversation
    (`offered`: the request's tools, as `tools.offered` reads them)."""
    _checked(body)
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    # a reply always starts a new assistant turn: a final assistant item is not a prefill here
    oai: dict[str, Any] = {"model": model, "messages": system + list(earlier) + _input(body),
                           "add_generation_prompt": True, "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        oai["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "parallel_tool_calls", *EXTENSIONS):
        if body.get(name) is not None:
            oai[name] = body[name]
    offered = offered if offered is not None else tools.offered(body)
    if offered.tools:
        oai["tools"] = offered.tools
    tools.tool_choice(body, oai)
    _text_format(body, oai)
    _reasoning(body, oai)
    return oai


@bp.post("/v1/responses")
def create():
    body = serving.read_body()
    model = serving.resolve_model(body)
    store = _store()
    offered = tools.offered(body)
    oai = to_openai(body, model, history(store, body), offered)
    sub = serving.parse_submit(oai, chat=True)
    suffix = sub.parsed.request.id.split("-", 1)[-1]
    writer = ResponseWriter({**new_response(body, "resp_" + suffix, model), "tools": offered.echo}, suffix,
                            offered.call_name)
    asked = oai["messages"][1 if body.get("instructions") else 0:]   # what a later turn continues

    def finished(response: dict[str, Any]) -> None:
        if body.get("store") is not False:
            store.put(response["id"], Stored(asked + messages(response["output"], "output"), response))

    def whole(deltas: list[Delta], done: Done) -> dict[str, Any]:
        for d in deltas:
            writer.delta(d)
        writer.end(done)
        finished(writer.response)
        return writer.response

    return serving.reply(sub, lambda: SseWriter(writer, finished), whole)


def _stored(rid: str) -> Stored:
    stored = _store().get(rid)
    if stored is None:
        raise NotFound(f"no response '{rid}' is stored on this server", param="response_id")
    return stored


@bp.get("/v1/responses/<rid>")
def retrieve(rid: str):
    return jsonify(_stored(rid).response)


@bp.delete("/v1/responses/<rid>")
def delete(rid: str):
    _stored(rid)
    _store().delete(rid)
    return jsonify({"id": rid, "object": "response.deleted", "deleted": True})
