"""JSON calls between two markers: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
repeated (Hermes 2 Pro and 3, Qwen 2.5, Qwen3, QwQ, SmolLM3 and the generic format this
appliance describes to templates without tools). Families that differ only in the markers or
the keys are rows of TAGGED.

While a call streams, its name is known once `"name": "..."` is written and its arguments grow
member by member (base.open_json); a block that does not read as a call of the request's tools
stays content.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import ClassVar

from .base import Call, Context, Format, Parsed, dump_args, held, json_prefix, open_json, partial_suffix
from .json_grammar import Lark, allowed, q, value

NAME = re.compile(r'\s*\{\s*"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,?\s*')
ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


class TaggedJson(Format):
    """Calls as JSON objects {"name", "arguments"} between `open` and `close`."""
    name: ClassVar[str] = "hermes"
    open: ClassVar[str] = "<tool_call>"
    close: ClassVar[str] = "</tool_call>"

    @classmethod
    def detect(cls, src: str) -> bool:
        return cls.open in src

    @property
    def markers(self) -> tuple[str, ...]:   # type: ignore[override]
        return (self.open,)

    def calls(self, text: str, ctx: Context, partial: bool) -> tuple[str, list[Call]]:
        content, calls, pos = [], [], 0
        while True:
            at = text.find(self.open, pos)
            if at < 0:
                break
            body_at = at + len(self.open)
            end = text.find(self.close, body_at)
            if end < 0:   # still open: a call once its arguments have opened (cut off: as far as it got)
                call = self._open_call(text[body_at:], ctx)
                if call is None and not partial:
                    break                       # never a call: what it is, it is as content
                content.append(text[pos:at])
                calls += [call] if call is not None else []   # else held: it may still become one
                return _joined(content, partial, ""), calls
            call = self._call(text[body_at:end], ctx)
            if call is None:                    # not a call of these tools: it stays content
                content.append(text[pos:end + len(self.close)])
            else:
                content.append(text[pos:at])
                calls.append(call)
            pos = end + len(self.close)
        tail = text[pos:]
        if partial:
            tail = tail[: len(tail) - partial_suffix(tail, (self.open,))]
        content.append(tail)
        return _joined(content, partial, ""), calls

    def _call(self, body: str, ctx: Context) -> Call | None:
        got = json_prefix(body)
        if got is None or body[got[1]:].strip():
            return None
        obj = got[0]
        if not isinstance(obj, dict):
            return None
        name = obj.get("name", obj.get("function"))
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if name not in ctx.tools or not isinstance(args, dict):
            return None
        return Call(name, _as_written(body, args))

    def _open_call(self, body: str, ctx: Context) -> Call | None:
        """A call still being written: named once its name is, arguments as far as final."""
        m = NAME.match(body)
        if m is None:
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        if name not in ctx.tools:
            return None
        rest = body[m.end():]
        a = ARGS.match(rest)
        if a is None or not rest[a.end():].startswith("{"):
            return None                         # named once its arguments open: before, it may be no call
        return Call(name, open_json(rest[a.end():]), closed=False)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice (json_grammar.py's contract): an optional
        <think> block (the prompt's open one: its rest and </think>), content up to the first call,
        then each call's {"name": ..., "arguments": {...}} between the tags, any whitespace around."""
        names = allowed(ctx.tools, choice)
        if not names:
            return None
        one = call_object(ctx, names)
        g = Lark()
        w = g.ws
        g.add("body", f"{w} {value(one)} {w} {q(self.close)}")
        more = f"({w} {q(self.open)} body)* {w}" if ctx.parallel else w
        think = self.think if ctx.extract_reasoning else None
        thought = g.upto(think[1], inner=(self.open, self.close)) if think else ""
        if think and ctx.thinking_open:
            return g.text(f"{thought} {g.upto(self.open)} body {more}")
        said = f"{g.upto(self.open, think[0] if think else '')} body {more}"
        return g.text(f"{w} {q(think[0])} {thought} {g.upto(self.open)} body {more} | {said}" if think else said)


def _as_written(body: str, args: dict) -> str:
    """The arguments' text as the model wrote it, where the call streamed it so (its name first,
    then its arguments object): the streamed text is then a prefix of it. Else re-serialized."""
    m = NAME.match(body)
    rest = body[m.end():] if m else ""
    a = ARGS.match(rest)
    if a and rest[a.end():].startswith("{"):
        got = json_prefix(rest[a.end():])
        if got is not None and got[0] == args:
            return rest[a.end():a.end() + got[1]]
    return dump_args(args)


def _joined(parts: list[str], partial: bool, _: str) -> str:
    return held("".join(parts), partial).strip()


class Generic(TaggedJson):
    """A template without tool support: the appliance describes the tools and this format in a
    system message (tools.py) and reads calls as hermes. A model that was never taught the
    format, forced to call, starts with the call (text first, it rambles to max_tokens) and
    ends with it: the system message asks for one call and nothing else (a small model, let
    go on, writes the same call again to max_tokens). Several written are still read."""
    name = "generic"

    def __init__(self, inner: Format | None = None) -> None:
        self.inner = inner    # the template's own format: its reasoning (and content) as it reads them

    @classmethod
    def detect(cls, src: str) -> bool:
        return False

    @property
    def supports_thinking(self) -> bool:   # type: ignore[override]
        return self.inner.supports_thinking if self.inner is not None else super().supports_thinking

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return (self.inner or super()).prompt_opens_thinking(prompt)

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        """The template's own reading of reasoning and content, then calls out of the content."""
        if self.inner is None:
            return super().parse(text, ctx, partial)
        plain = self.inner.parse(text, replace(ctx, tools={}), partial)
        if not ctx.tools:
            return plain
        content, calls = self.calls(plain.content, ctx, partial)
        return Parsed(content, plain.reasoning, calls)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        names = allowed(ctx.tools, choice)
        if not names:
            return None
        one = call_object(ctx, names)
        g = Lark()   # exactly the layout the system message shows ("reply with" one call "and
        g.add("body", f'"\\n" {value(one)} "\\n" {q(self.close)}')   # nothing else"): done once it closes
        return g.text(f"{q(self.open)} body")


def call_object(ctx: Context, names: list[str]) -> dict:
    """The JSON schema of one call of the tools `names`: {"name": ..., "arguments": {...}}."""
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": n}, "arguments": ctx.tools[n] or {"type": "object"}}}
                      for n in names]}
