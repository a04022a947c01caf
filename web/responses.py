"""OpenAI responses from engine events: the JSON body of a finished chat or completion, and the
SSE chunks of a streamed one (`ChunkWriter`).

The request side (parsing and validation) is `wire.py`; this module only shapes what the engine
produced (text, reasoning, tool calls, logprobs, usage, timings) into OpenAI's format.
"""
from __future__ import annotations

import json
import time
from typing import Any

from appliance.engine.types import Delta, Done, TokenLogprob, ToolCall
from appliance.errors import ApplianceError

from .wire import ParsedRequest

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: keeps a connection alive, ignored by clients


def usage_dict(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                                          for t in e.top]} for e in entries],
            "refusal": None}


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def chat_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    calls = [c for d in deltas for c in d.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.text for d in deltas)}
    reasoning = "".join(d.reasoning for d in deltas)
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = tool_call_dicts(calls)
    return {
        "id": p.request.id, "object": "chat.completion", "created": int(time.time()), "model": p.model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "message": message,
                     "logprobs": _chat_logprobs(lps) if p.request.params.logprobs else None,
                     "finish_reason": done.finish_reason}],
        "usage": usage_dict(done), "timings": done.timings.as_dict(),
    }


def completion_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    return {
        "id": p.request.id, "object": "text_completion", "created": int(time.time()), "model": p.model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": "".join(d.text for d in deltas),
                     "logprobs": _completion_logprobs(lps, 0) if p.request.params.logprobs else None,
                     "finish_reason": done.finish_reason}],
        "usage": usage_dict(done), "timings": done.timings.as_dict(),
    }


class ChunkWriter:
    """Builds the SSE chunks of one streamed response, chat or completion."""

    def __init__(self, p: ParsedRequest, chat: bool, fingerprint: str) -> None:
        self.p, self.chat = p, chat
        self.base = {"id": p.request.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": p.model, "system_fingerprint": fingerprint}
        self._delta_parts: tuple[bytes, bytes] | None = None
        self._offset = 0  # text_offset of the legacy completions logprobs

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body = {**self.base, "choices": [choice] if choice is not None else [], **extra}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def start(self) -> bytes:
        return self._chunk(self._choice("", None, role=True)) if self.chat else b""

    def delta(self, ev: Delta) -> bytes:
        out = b""
        if ev.reasoning and self.chat:
            out += self._chunk({"index": 0, "delta": {"reasoning_content": ev.reasoning}, "logprobs": None,
                                "finish_reason": None})
            if not (ev.text or ev.call_parts or ev.logprobs):
                return out
        if ev.call_parts and self.chat:
            for c in ev.call_parts:  # OpenAI's shape: id, type and name first, then the arguments as they come
                if c.id:
                    call = {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
                else:
                    call = {"index": c.index, "function": {"arguments": c.arguments}}
                out += self._chunk({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None})
            if not ev.text:
                return out
        if ev.tool_calls and not (ev.text or ev.logprobs):   # a call completed; its parts went before
            return out
        if ev.logprobs:
            choice = self._choice(ev.text, None)
            if self.chat:
                choice["logprobs"] = _chat_logprobs(list(ev.logprobs))
            else:
                choice["logprobs"] = _completion_logprobs(list(ev.logprobs), self._offset)
            self._offset += sum(len(e.token) for e in ev.logprobs)
            return out + self._chunk(choice)
        return out + self._text_chunk(ev.text)

    def _text_chunk(self, text: str) -> bytes:
        # the hot path (one call per token): the chunk around the text is encoded once
        if self._delta_parts is None:
            marker = "\x00TEXT\x00"
            whole = self._chunk(self._choice(marker, None)).decode()
            at = whole.index(json.dumps(marker)[1:-1]) - 1
            self._delta_parts = (whole[:at].encode(), whole[at + len(json.dumps(marker)):].encode())
        head, tail = self._delta_parts
        return head + json.dumps(text).encode() + tail

    def end(self, done: Done) -> bytes:
        out = self._chunk(self._choice(None if self.chat else "", done.finish_reason),
                          timings=done.timings.as_dict())
        if self.p.include_usage:
            out += self._chunk(None, usage=usage_dict(done))
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(e: ApplianceError) -> bytes:
        return b"data: " + json.dumps(e.body()).encode() + b"\n\n"

    @staticmethod
    def idle() -> bytes:
        return KEEPALIVE
