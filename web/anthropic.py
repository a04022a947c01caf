"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as Claude
Code and the `anthropic` SDK speak it, translated to and from the OpenAI chat request that the
rest of the server serves: one validation (`wire.parse_chat`), one engine, the same prompt
cache, speculation, timings and limits.

Request: `system` (a string or text blocks), `messages` with content as a string or blocks
(`text`, `image`; `tool_use` and `tool_result` blocks, a result's `is_error`, text and image
blocks; `thinking` blocks of earlier turns are the assistant message's `reasoning_content`, which
templates that keep earlier reasoning render) and a `system` message anywhere in them (Claude
Code's); an empty `messages` renders what there is (the system prompt), as llama-server does;
`tools` with `input_schema` (tools of Anthropic's own types, which its service runs or its
models know without a schema, are left out of the prompt), `tool_choice` (auto, any, tool,
none; `disable_parallel_tool_use`), `stop_sequences`, `temperature`, `top_p`, `top_k`,
`max_tokens` (required, and a ceiling: past the context's end the reply stops there),
`thinking` (enabled, adaptive or disabled: the template's `enable_thinking`; the budget is not
enforced), `output_config.effort` (the template's reasoning effort) and `.format` (a JSON
schema: the same structured output), `context_management`'s clear_thinking edit (the thinking
of all but the last `keep` turns left out), `metadata` (accepted). The reply is
web/anthropic_writer.py's; errors have Anthropic's shape and status codes.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from flask import Blueprint, jsonify
from werkzeug.exceptions import HTTPException

from appliance.errors import ApplianceError, InvalidRequest

from . import images, serving
from .anthropic_writer import ERROR_TYPES, EventWriter, error_body, message_response
from .reasoning import reasoning_kwargs

bp = Blueprint("anthropic", __name__)

# what the API takes; those that say how Anthropic's service runs a request (service tier, region,
# speed, workspace, caching hints, effort) are accepted and have no effect here
TOP_LEVEL = {"model", "messages", "system", "max_tokens", "metadata", "stop_sequences", "stream", "temperature",
             "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config", "service_tier", "container",
             "mcp_servers", "cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id",
             "workspace_id", "context_management"}
THINKING_ON = ("enabled", "adaptive", "between_tools")
ROLES = ("user", "assistant", "system")
BILLING = "x-anthropic-billing-header:"
# the context_management edits done here: thinking cleared from all but the last turns
THINKING_EDITS = ("clear_thinking_20251015",)


@bp.errorhandler(ApplianceError)
def _anthropic_error(e: ApplianceError):
    return jsonify(error_body(e)), e.status


@bp.errorhandler(HTTPException)
def _anthropic_http_error(e: HTTPException):
    status = e.code or 500
    return jsonify({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                               "message": e.description or e.name}}), status


# -- request: Anthropic -> OpenAI ---------------------------------------------------------------
def _need(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _need(isinstance(content, list) and all(isinstance(b, dict) for b in content),
          f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    return content


def _billing(text: str) -> str:
    """`text` without Claude Code's attribution line (its first system block): a hash of the
    request that changes from one to the next, for Anthropic's billing and never for the model.
    Left in, it would be the prompt's first tokens, and no prompt would share a cached prefix
    with another."""
    if not text.startswith(BILLING):
        return text
    return text.split("\n", 1)[1] if "\n" in text else ""


def _text_of(blocks: list[dict[str, Any]], where: str, each: Callable[[str], str] = str) -> str:
    parts = []
    for i, b in enumerate(blocks):
        _need(b.get("type") == "text" and isinstance(b.get("text"), str),
              f"{where}[{i}] must be a text block; {b.get('type')!r} blocks are not supported here", f"{where}[{i}]")
        parts.append(each(b["text"]))
    return "".join(parts)


def _part(b: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A text or image block as OpenAI's part (images as data: URIs: web/images.py reads them);
    None for a block of another type."""
    kind = b.get("type")
    if kind == "text":
        _need(isinstance(b.get("text"), str), f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": b["text"]}
    if kind == "image":
        return images.image_url_part(_image_url(b.get("source"), f"{where}.source"))
    return None


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """OpenAI's content for these parts: their text, or the parts themselves with a picture."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool's result as OpenAI's tool message: its text, and its pictures where they were
    (a screenshot tool's), which reach a model that takes images as a user turn's do."""
    _need(isinstance(b.get("tool_use_id"), str), f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    parts = [{"type": "text", "text": "Error: "}] if b.get("is_error") else []
    for k, block in enumerate(_blocks(b.get("content", ""), where)):
        part = _part(block, f"{where}.content[{k}]")
        _need(part is not None, f"{where}.content[{k}]: {block.get('type')!r} blocks are not supported in a "
              "tool_result (text and image are)", f"{where}.content[{k}].type")
        parts.append(part)
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": _content(parts)}


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first (as OpenAI's tool messages), then its text and images."""
    out, parts = [], []
    for i, b in enumerate(blocks):
        if b.get("type") == "tool_result":
            out.append(_tool_result(b, f"{where}.content[{i}]"))
            continue
        part = _part(b, f"{where}.content[{i}]")
        if part is None:
            raise InvalidRequest(f"{where}.content[{i}]: {b.get('type')!r} blocks are not supported in a user turn "
                                 "(text, image and tool_result are)", param=f"{where}.content[{i}].type")
        parts.append(part)
    if parts or not out:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URI; a url source as it is."""
    _need(isinstance(source, dict) and source.get("type") in ("base64", "url"),
          f"{where} must be an object of type base64 or url", where)
    if source["type"] == "url":
        _need(isinstance(source.get("url"), str), f"{where}.url must be a string", f"{where}.url")
        return source["url"]
    _need(isinstance(source.get("data"), str), f"{where}.data must be a base64 string", f"{where}.data")
    return images.data_url(str(source.get("media_type") or "image/png"), source["data"])


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, calls, thoughts = [], [], []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "thinking":   # earlier reasoning: templates that keep it in history get it
            thoughts.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            _need(isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict),
                  f"{where}.content[{i}]: a tool_use block needs an id, a name and an input object",
                  f"{where}.content[{i}]")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind != "redacted_thinking":
            raise InvalidRequest(f"{where}.content[{i}]: {kind!r} blocks are not supported in an assistant turn",
                                 param=f"{where}.content[{i}].type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if any(thoughts):
        msg["reasoning_content"] = "".join(thoughts)
    return msg


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    _need(isinstance(msgs, list), "'messages' must be a list", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(_blocks(system, "system"), "system", each=_billing)})
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        _need(isinstance(m, dict) and m.get("role") in ROLES, f"{where}.role must be one of {', '.join(ROLES)}",
              f"{where}.role")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "system":   # Claude Code's: instructions at that point of the conversation
            out.append({"role": "system", "content": _text_of(blocks, f"{where}.content")})
        else:
            out += _user(blocks, where) if m["role"] == "user" else [_assistant(blocks, where)]
    # no messages: the system prompt alone is rendered (a template that needs a user turn says so)
    _need(bool(out), "'messages' is empty and there is no 'system': there is nothing to answer", "messages")
    return out


def _tools(body: dict[str, Any], oai: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        _need(isinstance(tools, list), "'tools' must be a list", "tools")
        oai["tools"] = []
        for i, t in enumerate(tools):
            _need(isinstance(t, dict), f"tools[{i}] must be an object", f"tools[{i}]")
            if t.get("type") not in (None, "custom"):   # web_search_20250305, bash_20250124...: left out
                continue
            _need(isinstance(t.get("name"), str) and isinstance(t.get("input_schema"), dict),
                  f"tools[{i}] needs a name and an input_schema object", f"tools[{i}]")
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            oai["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return
    _need(isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none"),
          "'tool_choice' must be an object whose type is auto, any, tool or none", "tool_choice")
    kind = choice["type"]
    if kind == "tool":
        _need(isinstance(choice.get("name"), str), "tool_choice of type 'tool' needs a name", "tool_choice.name")
        oai["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        oai["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True:
        oai["parallel_tool_calls"] = False


def _thinking(body: dict[str, Any], oai: dict[str, Any]) -> None:
    """`thinking` turns the template's thinking on or off; `output_config.effort` sets how much
    (gpt-oss's reasoning_effort: low, medium, high; max and xhigh think without a level)."""
    config = body.get("output_config")
    _need(config is None or isinstance(config, dict), "'output_config' must be an object", "output_config")
    kwargs = reasoning_kwargs((config or {}).get("effort"), "output_config.effort")
    thinking = body.get("thinking")
    if thinking is not None:
        _need(isinstance(thinking, dict) and thinking.get("type") in (*THINKING_ON, "disabled"),
              "'thinking' must be an object whose type is enabled, adaptive, between_tools or disabled", "thinking")
        kwargs["enable_thinking"] = thinking["type"] != "disabled"
    if kwargs:
        oai["chat_template_kwargs"] = kwargs


def _context_management(body: dict[str, Any]) -> int | None:
    """How many of the last turns' thinking the clear_thinking edit keeps (None: all, as without
    the edit). An edit that would clear tool results is refused by name: it is not done here."""
    cm = body.get("context_management")
    if cm is None:
        return None
    edits = cm.get("edits", []) if isinstance(cm, dict) else None
    _need(isinstance(edits, list), "'context_management' must be an object with a list of edits", "context_management")
    keep = None
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        _need(kind in THINKING_EDITS, f"{where}: {kind!r} edits are not supported by this server; "
              f"{', '.join(THINKING_EDITS)} is", f"{where}.type")
        turns = edit.get("keep", {"type": "thinking_turns", "value": 1})   # Anthropic's default: the last
        if turns == "all":
            continue
        n = turns.get("value") if isinstance(turns, dict) and turns.get("type") == "thinking_turns" else None
        _need(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
              f"{where}.keep must be \"all\" or {{\"type\": \"thinking_turns\", \"value\": N}}", f"{where}.keep")
        keep = n if keep is None else min(keep, n)
    return keep


def _clear_thinking(messages: list[dict[str, Any]], keep: int | None) -> None:
    """The earlier assistant messages' thinking left out, but for the last `keep` that have some."""
    if keep is None:
        return
    thinking = [m for m in messages if "reasoning_content" in m]
    for m in thinking[:max(len(thinking) - keep, 0)]:
        del m["reasoning_content"]


def _output_format(body: dict[str, Any], oai: dict[str, Any]) -> None:
    """output_config.format (a JSON schema the reply must follow): the same structured output."""
    config = body.get("output_config")
    if config is None:
        return
    fmt = config.get("format")
    if fmt is None:
        return
    _need(isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict),
          "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
    oai["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_openai(body: dict[str, Any], model: str, count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat body that serves this Messages request."""
    unknown = sorted(set(body) - TOP_LEVEL)
    _need(not unknown, f"unknown field(s): {', '.join(unknown)}", unknown[0] if unknown else "")
    oai: dict[str, Any] = {"model": model, "messages": _messages(body)}
    if not count_only:
        max_tokens = body.get("max_tokens")
        _need(isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1,
              "'max_tokens' is required: a positive integer", "max_tokens")
        oai["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                oai[name] = body[name]
        stops = body.get("stop_sequences")
        if stops is not None:
            _need(isinstance(stops, list) and all(isinstance(s, str) for s in stops),
                  "'stop_sequences' must be a list of strings", "stop_sequences")
            oai["stop"] = stops
        stream = body.get("stream")
        _need(stream is None or isinstance(stream, bool), "'stream' must be true or false", "stream")
        oai["stream"] = bool(stream)
        if oai["stream"]:
            oai["stream_options"] = {"include_usage": True}
    _tools(body, oai)
    _thinking(body, oai)
    _clear_thinking(oai["messages"], _context_management(body))
    _output_format(body, oai)
    metadata = body.get("metadata")
    _need(metadata is None or isinstance(metadata, dict), "'metadata' must be an object", "metadata")
    return oai


@bp.post("/v1/messages")
def messages():
    body = serving.read_body()
    model = serving.resolve_model(body)
    oai = to_openai(body, model)
    # max_tokens is a ceiling: past the context's end the reply stops there (stop_reason max_tokens)
    sub = serving.parse_submit(oai, chat=True, adjust=serving.ceiling(oai.pop("max_tokens")))
    return serving.reply(sub, lambda: EventWriter(sub, model),
                         lambda deltas, done: message_response(sub, model, deltas, done))


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    """The prompt's tokens as the model's template and tokenizer make them (nothing is run)."""
    body = serving.read_body()
    model = serving.resolve_model(body)
    return jsonify({"input_tokens": len(serving.render_prompt(to_openai(body, model, count_only=True)).ids)})

