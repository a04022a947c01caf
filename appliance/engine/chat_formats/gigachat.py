"""GigaChat 3 and 3.1: content, then one call as a JSON object after a marker.

    [generation prompt: assistant<|role_sep|>\\n]
    CONTENT<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{"name": "NAME", "arguments": {...}}   (GigaChat 3)
    CONTENT<|function_call|>{"name": "NAME", "arguments": {...}}                                  (GigaChat 3.1)

One call per reply ("name" first, then "arguments"). llama.cpp reads GigaChat 3 with its own
parser (common/parsers/gigachat-v3.cpp) and 3.1 with its automatic one; both are read here as
the former reads: the content runs to the marker, nothing is trimmed, and what follows a call,
or a marker that is not followed by a call of the request's tools, is dropped as llama.cpp
drops it.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, closed_args, held, json_prefix, open_json
from .peg import FAIL, MORE, SPACE, lit, until, until_rule


class GigaChat(Format):
    name: ClassVar[str] = "gigachat-v3"
    think = None
    section: ClassVar[str] = "<|message_sep|>\n\n"                       # where the content stops
    opener: ClassVar[str] = "<|message_sep|>\n\nfunction call<|role_sep|>\n"

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<|role_sep|>" in src and "<|message_sep|>" in src and "<|function_call|>" not in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        if not ctx.tools:
            return Parsed(held(text, partial))
        at, found = until(text, 0, self.section)
        content = held(text[:at], partial)
        p = lit(text, at, self.opener) if found else FAIL
        if p < 0:
            return Parsed(content)
        call = self._call(text, p, ctx)
        if call is None:
            return Parsed(content)
        if not call.closed and not partial:
            call = Call(call.name, closed_args(call.arguments))
        return Parsed(content, "", [call])

    def _call(self, text: str, pos: int, ctx: Context) -> Call | None:
        """`{"name": "NAME", "arguments": {...}}` with any spacing; None until it is named or
        where it is not a call of these tools."""
        p = _steps(text, pos, "{", '"name"', ":", '"')
        if p < 0:
            return None
        for name in ctx.tools:
            q = _steps(text, p, name + '"', ",", '"arguments"', ":")
            if q == FAIL:
                continue
            if q == MORE:
                return Call(name, "", closed=False) if lit(text, p, name + '"') > 0 else None
            q = SPACE.match(text, q).end()
            body = text[q:]
            got = json_prefix(body) if body.startswith("{") else None
            if got is None:
                return Call(name, open_json(body), closed=False) if body.startswith("{") or not body else None
            end = lit(text, SPACE.match(text, q + got[1]).end(), "}")
            if end == FAIL:
                return None
            return Call(name, body[:got[1]], closed=end > 0)
        return None

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, as llama.cpp's grammar for it: the content (any
        text, optional) up to the marker, then one call (GigaChat has no parallel calls) of an
        allowed tool (`choice`: "required" or that tool's name) as `{"name": ..., "arguments":
        ...}` with the arguments of its schema, JSON's whitespace anywhere. No reasoning. The
        markers are literals (special tokens); the content ends at the first one."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        one = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": n}, "arguments": ctx.tools[n] or {"type": "object"}}}
                         for n in allowed]}
        rest = self.opener[len(self.section):]
        head = f"pre {json.dumps(rest)}" if rest else "pre"
        return f"start: {head} %json {json.dumps(one)}\n" + until_rule("pre", self.section)

    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return (self.opener,)


class GigaChat31(GigaChat):
    """GigaChat 3.1: the call after `<|function_call|>` (llama.cpp's automatic parser)."""
    name = "gigachat-3.1"
    section = opener = "<|function_call|>"

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<|role_sep|>" in src and "<|function_call|>" in src


def _steps(text: str, pos: int, *parts: str) -> int:
    """The parts in turn, whitespace allowed between them: where the last ends, MORE or FAIL."""
    for i, part in enumerate(parts):
        pos = lit(text, SPACE.match(text, pos).end() if i else pos, part)
        if pos < 0:
            return pos
    return pos
