"""Kimi K3: sections opened and closed by tags (its "XTML").

    [generation prompt: <|open|>message role="assistant"<|sep|><|open|>think<|sep|>]
    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

Each section's opener and closer may be missing (a model that skips the closer, a reply cut
short). An argument's value is typed by the tool's schema, not by its type="..." attribute: a
parameter typed "string" (or untyped) is the text, any other is the JSON written.

This reads the reply as llama.cpp's parser (common/parsers/kimi-k3.cpp, a PEG) does: nothing is
trimmed. Where llama.cpp's parse fails (text after the message, a call of an unknown tool), the
text from that point on stays content, so no text is lost.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, held
from .peg import FAIL, MORE, lit, until, until_any, until_rule

SEP = "<|sep|>"
MSG_START = '<|open|>message role="assistant"<|sep|>'
THINK_START, THINK_END = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
RESP_START, RESP_END = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
TOOLS_START, TOOLS_END = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
CALL_START, CALL_END = '<|open|>call tool="', "<|close|>call<|sep|>"
ARG_START, ARG_END = '<|open|>argument key="', "<|close|>argument<|sep|>"
MSG_END, EOM = "<|close|>message<|sep|>", "<|end_of_msg|>"


def optional(text: str, pos: int, s: str) -> int:
    """An optional literal: where it ends, `pos` where it is not there, MORE where the text ends in it."""
    p = lit(text, pos, s)
    return pos if p == FAIL else p


class KimiK3(Format):
    name: ClassVar[str] = "kimi-k3"
    think = (THINK_START, THINK_END)

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<|open|>" in src and "<|close|>" in src and "<|end_of_msg|>" in src

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        r = _Reading(text, ctx)
        r.run()
        reasoning = "".join(r.reasoning)
        if not reasoning.strip(" \n\r\t"):
            reasoning = ""
        if r.calls and not r.calls[-1].closed and not partial:
            r.calls[-1] = Call(r.calls[-1].name, r.calls[-1].arguments + "}")
        return Parsed(held("".join(r.content), partial), held(reasoning, partial), r.calls)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, as llama.cpp's grammar for it (kimi-k3.cpp):
        the think section (the generation prompt opened it; else its openers are optional),
        ended by its closer or by the response opener; the response section (optional); then
        the tools section with one call (or several, with parallel calls) of the allowed tools
        (`choice`: "required" or that tool's name), each with any of its tool's arguments: a
        parameter the schema types as a string (or not at all) as text up to the argument's
        closer, any other as JSON of its schema; the attributes after a call's tool name and an
        argument's key as written (up to `<|sep|>`); then the message's closer and
        `<|end_of_msg|>`, optional. Markers are literals in rules (special tokens)."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules = []
        for i, n in enumerate(allowed):
            props = (ctx.tools[n] or {}).get("properties") or {}
            args = []
            for key, schema in props.items():
                value = "text" if _type(schema) == "string" else f"WS? %json {json.dumps(schema or {})} WS? {json.dumps(ARG_END)}"
                args.append(f'{json.dumps(ARG_START)} {json.dumps(key + chr(34))} attrs {value}')
            body = f" arg_{i}*" if args else ""
            rules.append(f'call_{i}: {json.dumps(CALL_START)} {json.dumps(n + chr(34))} attrs{body} {json.dumps(CALL_END)}')
            if args:
                rules.append(f"arg_{i}: " + " | ".join(args))
        calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
        rep = "+" if ctx.parallel else ""
        head = "thought" if ctx.thinking_open else f"({json.dumps(MSG_START)}? {json.dumps(THINK_START)} thought)?"
        return "\n".join([
            f"start: {head} response? {json.dumps(TOOLS_START)} call{rep} {json.dumps(TOOLS_END)}"
            f" {json.dumps(MSG_END)}? {json.dumps(EOM)}?",
            f"response: {json.dumps(RESP_START)}? response_text",
            f"call: {calls}", *rules,
            r"WS: /[ \t\n\r]+/",
        ]) + "\n" + "".join([
            until_rule("thought", (THINK_END, RESP_START)),
            until_rule("response_text", RESP_END, not_after="<|open|>"),
            until_rule("attrs", SEP),
            until_rule("text", ARG_END),
        ])


def _type(schema) -> str:
    t = schema.get("type") if isinstance(schema, dict) else None
    return t if isinstance(t, str) else "string"


    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return (CALL_START,)


class _Reading:
    """One parse: [think] [response] [tools] [message closer], as far as the text goes."""

    def __init__(self, text: str, ctx: Context) -> None:
        self.text, self.ctx = text, ctx
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []

    def run(self) -> None:
        text, p = self.text, 0
        if not self.ctx.thinking_open:          # the generation prompt opens the message and the think
            p = optional(text, p, MSG_START)
            if p >= 0:
                p = optional(text, p, THINK_START)
        if p >= 0:
            p = self.section(p, (THINK_END, RESP_START), self.reasoning if self.ctx.extract_reasoning
                             else self.content, THINK_END, open_=None)
        if p >= 0:
            p = self.section(p, (RESP_END, TOOLS_START, MSG_END), self.content, RESP_END, open_=RESP_START)
        if p >= 0 and self.ctx.tools:
            got = self.tools(p)
            p = got if got != FAIL else p
        if p >= 0:
            p = optional(text, p, MSG_END)
        if p >= 0:
            p = optional(text, p, EOM)
        if 0 <= p < len(text):                  # llama.cpp fails: the rest stays content
            self.content.append(text[p:])

    def section(self, pos: int, stops: tuple[str, ...], into: list[str], close: str, open_: str | None) -> int:
        p = pos if open_ is None else optional(self.text, pos, open_)
        if p < 0:
            return p
        end, ended = until_any(self.text, p, stops)
        into.append(self.text[p:end])
        return optional(self.text, end, close) if ended else MORE

    def tools(self, pos: int) -> int:
        p = lit(self.text, pos, TOOLS_START)
        if p < 0:
            return p
        n, before = 0, len(self.calls)
        while True:
            got = self.call(p)
            if got == FAIL:
                break
            if got == MORE:
                return MORE
            p, n = got, n + 1
        p = lit(self.text, p, TOOLS_END) if n else FAIL
        if p == FAIL:                           # the section is not read: none of its calls
            del self.calls[before:]
        return p

    def call(self, pos: int) -> int:
        p = lit(self.text, pos, CALL_START)
        if p < 0:
            return p
        for name, params in self.ctx.tools.items():
            q = lit(self.text, p, f'{name}"')
            if q == FAIL:
                continue
            if q == MORE:
                return MORE
            end, ended = until(self.text, q, SEP)
            if not ended:
                return MORE
            q = lit(self.text, end, SEP)
            if q < 0:
                return q
            call = Call(name, "{", closed=False)
            self.calls.append(call)
            got = self.arguments(q, (params or {}).get("properties") or {}, call)
            if got != FAIL:
                return got
            self.calls.pop()
        return FAIL

    def arguments(self, pos: int, props: dict, call: Call) -> int:
        members: list[str] = []
        p = pos
        while props:
            got = self.argument(p, props)
            if got == MORE:
                return MORE
            if got == FAIL:
                break
            members.append(got[0])
            call.arguments, p = "{" + ",".join(members), got[1]
        end = lit(self.text, p, CALL_END)
        if end > 0:
            call.arguments, call.closed = "{" + ",".join(members) + "}", True
        return end

    def argument(self, pos: int, props: dict):
        p = lit(self.text, pos, ARG_START)
        if p < 0:
            return p
        for key, schema in props.items():
            q = lit(self.text, p, f'{key}"')
            if q == FAIL:
                continue
            if q == MORE:
                return MORE
            end, ended = until(self.text, q, SEP)
            q = lit(self.text, end, SEP) if ended else MORE
            if q < 0:
                return q
            end, ended = until(self.text, q, ARG_END)
            close = lit(self.text, end, ARG_END) if ended else MORE
            if close < 0:
                return close
            return f"{json.dumps(key)}:{_value(self.text[q:end], _type(schema))}", close
        return FAIL


def _value(raw: str, kind: str) -> str:
    """An argument's text as JSON: the text itself for a string parameter, else the JSON written
    (llama.cpp passes it through; text that is no JSON is kept as a string here)."""
    if kind == "string":
        return json.dumps(raw, ensure_ascii=False)
    try:
        json.loads(raw)
        return raw
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
