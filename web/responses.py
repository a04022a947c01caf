"""OpenAI responses from engine events: the JSON body of a finished chat or completion, and the
SSE chunks of a streamed one (`ChunkWriter`).

The request side (parsing and validation) is `wire.py`; this module only shapes what the engine
produced (text, reasoning, tool calls, logprobs, usage, timings) into OpenAI's format.
"""
from __future__ import annotations

import json
import time
from typing import Any

from appliance.engine.types import Delta, Done, Progress, TokenLogprob, ToolCall
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


def _chat_choice(p: ParsedRequest, deltas: list[Delta], index: int, finish: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    calls = [c for d in deltas for c in d.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.text for d in deltas)}
    reasoning = "".join(d.reasoning for d in deltas)
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = tool_call_dicts(calls)
    return {"index": index, "message": message, "logprobs": _chat_logprobs(lps) if p.request.params.logprobs else None,
            "finish_reason": finish}


def _completion_choice(p: ParsedRequest, deltas: list[Delta], index: int, finish: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    return {"index": index, "text": "".join(d.text for d in deltas),
            "logprobs": _completion_logprobs(lps, 0) if p.request.params.logprobs else None, "finish_reason": finish}


def _response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str, chat: bool) -> dict[str, Any]:
    """The whole body: a choice per index (n of them for a request with n > 1), in order."""
    build = _chat_choice if chat else _completion_choice
    choices = [build(p, [d for d in deltas if d.index == end.index], end.index, end.finish_reason)
               for end in done.ends()]
    return {"id": p.request.id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": p.model, "system_fingerprint": fingerprint,
            "choices": choices, "usage": usage_dict(done), "timings": done.timings.as_dict()}


def chat_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    return _response(p, deltas, done, fingerprint, chat=True)


def completion_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    return _response(p, deltas, done, fingerprint, chat=False)


def progress_dict(ev: Progress) -> dict[str, Any]:
    """llama-server's prompt_progress object."""
    return {"total": ev.total, "cache": ev.cache, "processed": ev.processed, "time_ms": round(ev.time_ms, 3)}


class ChunkWriter:
    """Builds the SSE chunks of one streamed response, chat or completion."""

    def __init__(self, p: ParsedRequest, chat: bool, fingerprint: str) -> None:
        self.p, self.chat = p, chat
        self.base = {"id": p.request.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": p.model, "system_fingerprint": fingerprint}
        self._delta_parts: tuple[bytes, bytes] | None = None
        self._offsets: dict[int, int] = {}  # each choice's text_offset of the legacy completions logprobs

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body = {**self.base, "choices": [choice] if choice is not None else [], **extra}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False, index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    def start(self) -> bytes:
        if not self.chat:
            return b""
        return b"".join(self._chunk(self._choice("", None, role=True, index=i)) for i in range(self.p.request.n))

    def delta(self, ev: Delta) -> bytes:
        """The chunks one event makes: its reasoning, its tool-call parts, its text, each a chunk
        of its own, the event's logprobs on the last of them (OpenAI's stream: every chunk that
        carries a token carries its logprob; no chunk of empty content)."""
        choices: list[dict[str, Any]] = []
        if self.chat:
            if ev.reasoning:
                choices.append(self._delta_choice(ev.index, {"reasoning_content": ev.reasoning}))
            for c in ev.call_parts:  # OpenAI's shape: id, type and name first, then the arguments as they come
                if c.id:
                    call = {"index": c.index, "id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": ""}}
                else:
                    call = {"index": c.index, "function": {"arguments": c.arguments}}
                choices.append(self._delta_choice(ev.index, {"tool_calls": [call]}))
        if ev.text:
            if not ev.logprobs and ev.index == 0 and not choices and ev.timings is None:
                return self._text_chunk(ev.text)       # the hot path: one token's text
            choices.append(self._choice(ev.text, None, index=ev.index))
        if ev.logprobs and choices:
            entries = list(ev.logprobs)
            choices[-1]["logprobs"] = _chat_logprobs(entries) if self.chat else \
                _completion_logprobs(entries, self._offsets.get(ev.index, 0))
            self._offsets[ev.index] = self._offsets.get(ev.index, 0) + sum(len(e.token) for e in entries)
        if ev.timings is not None and choices:     # timings_per_token: on the event's last chunk
            return b"".join(self._chunk(c) for c in choices[:-1]) + \
                self._chunk(choices[-1], timings=ev.timings.as_dict())
        return b"".join(self._chunk(c) for c in choices)

    def progress(self, ev: Progress) -> bytes:
        """llama-server's prompt_progress chunk: no text, the prompt's figures beside the choice."""
        return self._chunk(self._choice(None if self.chat else "", None), prompt_progress=progress_dict(ev))

    @staticmethod
    def _delta_choice(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

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
        ends = done.ends()
        out = b"".join(self._chunk(self._choice(None if self.chat else "", e.finish_reason, index=e.index))
                       for e in ends[:-1])
        out += self._chunk(self._choice(None if self.chat else "", ends[-1].finish_reason, index=ends[-1].index),
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
