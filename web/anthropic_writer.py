"""Anthropic's Messages API's reply (web/anthropic.py takes the request): the message object
and its stream's events, built from the engine's events, and errors in Anthropic's shape.

Content blocks come in the order the model produced them (thinking, text, tool_use), with
`stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and the `stop_sequence` that
matched, and usage (input tokens, output tokens, prompt tokens read from the cache). A stream
follows Anthropic's event sequence: message_start, each block's start, deltas and stop,
message_delta, message_stop; `ping` while idle.
"""
from __future__ import annotations

import json
from typing import Any

from appliance import jsondepth
from appliance.engine.types import Delta, Done
from appliance.errors import ApplianceError

from . import serving

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}
def error_body(e: ApplianceError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# -- response: engine events -> Anthropic -------------------------------------------------------
def _stop(done: Done) -> tuple[str, str | None]:
    if done.stop_string is not None and done.finish_reason == "stop":
        return "stop_sequence", done.stop_string
    return STOP_REASONS.get(done.finish_reason, "end_turn"), None


def _usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _message_id(request_id: str) -> str:
    return "msg_" + request_id.split("-", 1)[-1]


def message_response(sub: serving.Submitted, model: str, deltas: list[Delta], done: Done) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    reasoning = "".join(d.reasoning for d in deltas)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = "".join(d.text for d in deltas)
    if text:
        content.append({"type": "text", "text": text})
    for c in (c for d in deltas for c in d.tool_calls):
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    reason, seq = _stop(done)
    return {"id": _message_id(sub.parsed.request.id), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(done),
            "timings": done.timings.as_dict()}


def _input(arguments: str) -> Any:
    try:
        return jsondepth.loads(arguments) if arguments else {}
    except ValueError:         # a call cut off, or nested too deep: its text as the model wrote it
        return {"_raw": arguments}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}, separators=(",", ":")).encode() + b"\n\n"


class EventWriter:
    """Anthropic's stream for one reply: blocks opened and closed in order, indices counted."""

    def __init__(self, sub: serving.Submitted, model: str) -> None:
        self.sub, self.model = sub, model
        self.index, self.open = -1, ""     # the current block's index and type ("" none)

    def start(self) -> bytes:
        acc = self.sub.accepted
        msg = {"id": _message_id(self.sub.parsed.request.id), "type": "message", "role": "assistant",
               "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": acc.n_prompt_tokens, "output_tokens": 0,
                         "cache_read_input_tokens": acc.n_cached, "cache_creation_input_tokens": 0}}
        return _event("message_start", {"message": msg})

    def _block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + _event("content_block_start", {"index": self.index, "content_block": block})

    def close(self) -> bytes:
        if not self.open:
            return b""
        out = b""
        if self.open == "thinking":
            out = _event("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}})
        self.open = ""
        return out + _event("content_block_stop", {"index": self.index})

    def delta(self, ev: Delta) -> bytes:
        out = b""
        if ev.reasoning:
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += _event("content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta", "thinking": ev.reasoning}})
        if ev.text:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out += _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": ev.text}})
        for c in ev.call_parts:     # a call's block opens with its name; its input streams as JSON text
            if c.id:
                out += self._block("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            else:
                out += _event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "input_json_delta", "partial_json": c.arguments}})
        return out

    def end(self, done: Done) -> bytes:
        reason, seq = _stop(done)
        usage = _usage(done)
        return (self.close() + _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                        "usage": usage, "timings": done.timings.as_dict()})
                + _event("message_stop", {}))

    @staticmethod
    def error(e: ApplianceError) -> bytes:
        return _event("error", {"error": error_body(e)["error"]})

    @staticmethod
    def idle() -> bytes:
        return _event("ping", {})


