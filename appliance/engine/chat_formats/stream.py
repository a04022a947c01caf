"""One streaming core for every format: the reply's text so far is parsed again as it grows and
what changed is sent, as llama-server does (common_chat_parse on the generated text, then
common_chat_msg_diff against the last message).

Content and reasoning are sent as they grow; a call is named (its id and name) once its name
is known, and its arguments are sent as their final text grows. A call is given complete
(`Piece.calls`, what a whole answer and Ollama's stream carry) once the format sees it
closed, or at the end of the reply. Whole and streamed answers are the same message, because
the end of the reply is one more parse, of the whole text, diffed against what was sent.

A format keeps the streaming rule (base.py): a partial parse is a prefix of every later one.
Where one breaks it (a reply that stops looking like a call), nothing already sent is taken
back: the change is logged and the rest is sent as it comes.
"""
from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass

from ..types import ToolCall, ToolCallPart
from .base import Context, Format, Parsed

log = logging.getLogger("appliance.engine")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class Piece:
    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()          # complete calls
    parts: tuple[ToolCallPart, ...] = ()      # the calls as they stream

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls or self.parts)


class ChatStream:
    """One reply's parser: `feed` text as it comes, `flush` at the end."""

    def __init__(self, fmt: Format, ctx: Context) -> None:
        self.fmt, self.ctx = fmt, ctx
        self.text = ""
        self.sent = Parsed()              # what the client has of the message
        self.ids: list[str] = []          # each call's id, once named
        self.done = 0                     # calls given complete

    @property
    def n_calls(self) -> int:
        return len(self.ids)

    def feed(self, text: str) -> Piece:
        if not text:
            return Piece()
        self.text += text
        return self._diff(self.fmt.parse(self.text, self.ctx, partial=True), final=False)

    def flush(self) -> Piece:
        return self._diff(self.fmt.parse(self.text, self.ctx, partial=False), final=True)

    def parse_whole(self) -> Parsed:
        return self.fmt.parse(self.text, self.ctx, partial=False)

    def _diff(self, new: Parsed, final: bool) -> Piece:
        out = Piece(self._grow("content", new.content), self._grow("reasoning", new.reasoning))
        parts, calls = [], []
        for i, call in enumerate(new.calls):
            if not call.name:
                break
            if i == len(self.ids):
                self.ids.append(call.id or new_call_id())
                self.sent.calls.append(type(call)(call.name, "", False, call.id))
                parts.append(ToolCallPart(i, self.ids[i], call.name))
            was = self.sent.calls[i]
            if call.arguments.startswith(was.arguments):
                delta = call.arguments[len(was.arguments):]
                if delta:
                    parts.append(ToolCallPart(i, arguments=delta))
                    was.arguments = call.arguments
            elif call.arguments != was.arguments:
                log.warning("a streamed tool call's arguments changed after they were sent: %r -> %r",
                            was.arguments, call.arguments)
            if (call.closed or final) and i == self.done:
                if not call.closed:      # cut off: its arguments closed as far as they came
                    tail = closing(was.arguments)
                    parts += [ToolCallPart(i, arguments=tail)] if tail else []
                    was.arguments += tail
                calls.append(ToolCall(self.ids[i], was.name, was.arguments or "{}"))
                self.done += 1
        if final:   # a call once named stays a call, as far as it got, its arguments closed
            for i in range(self.done, len(self.ids)):
                was = self.sent.calls[i]
                tail = closing(was.arguments)
                if tail:
                    parts.append(ToolCallPart(i, arguments=tail))
                    was.arguments += tail
                calls.append(ToolCall(self.ids[i], was.name, was.arguments))
            self.done = len(self.ids)
        out.parts, out.calls = tuple(parts), tuple(calls)
        return out

    def _grow(self, field: str, now: str) -> str:
        was = getattr(self.sent, field)
        if now.startswith(was):
            setattr(self.sent, field, now)
            return now[len(was):]
        if not was.startswith(now):
            log.warning("a streamed reply's %s changed after it was sent: %r -> %r", field, was[-40:], now[-40:])
        return ""


def closing(args: str) -> str:
    """What closes a call's arguments cut off after a complete member (`{"a": 1` -> `}`; nothing
    yet -> `{}`), so that a call the reply did not finish still carries a JSON object; empty
    where they are complete, or cannot be closed by appending."""
    if not args.strip():
        return "{}"
    stack, in_str, esc = [], False, False
    for ch in args:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    tail = ('"' if in_str else "") + "".join(reversed(stack))
    try:
        json.loads(args + tail)
    except (ValueError, RecursionError):   # not closable, or nested past what the parser takes
        return ""
    return tail
