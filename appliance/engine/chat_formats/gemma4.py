"""Gemma 4: thoughts on a channel, calls in Gemma's own object notation.

    <|channel>thought\nREASONING<channel|>CONTENT
    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:40,on:true,list:[1,2],obj:{k:null}}<tool_call|>

Strings are quoted by `<|"|>` (nothing inside is escaped), keys are bare, numbers, true, false
and null are JSON's. Calls follow the content back to back (several with parallel calls).

This reads the reply as llama.cpp's parser (common/parsers/gemma4.cpp, a PEG, with its mapper
in chat-peg-parser.cpp) does: nothing is trimmed; a stray `<channel|>` ends the content (with
tools, the text up to the next call is skipped); a block that does not read as a call of the
request's tools ends the reply. Where llama.cpp's parse fails (a reply that opens with
`<channel|>` or an unknown channel), the text stays content, so no text is lost.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from .base import Call, Context, Format, Parsed, held
from .gemma4_turns import fold_tool_responses
from .peg import FAIL, MORE, SPACE, lit, until, until_any, until_rule

CHANNEL, CLOSE, CALL, CALL_END, QUOTE = "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'
RESPONSE = "<|tool_response>"    # what the model writes after its calls, to hand over to the tools
THOUGHT = "<|channel>thought"
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")
KEY = re.compile(r"[^:}]+")


class Gemma4(Format):
    name: ClassVar[str] = "gemma4"
    think = None
    supports_thinking = True     # its own thought channel, read by parse

    @classmethod
    def detect(cls, src: str) -> bool:
        return "'<|tool_call>call:'" in src

    def messages(self, msgs: list[dict[str, Any]], src: str) -> list[dict[str, Any]]:
        return fold_tool_responses(msgs, src)

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        r = _Reading(text, ctx)
        r.run()
        reasoning = "".join(r.reasoning)
        if not reasoning.strip(" \n\r\t"):
            reasoning = ""
        calls = r.calls
        if calls and not calls[-1].closed and not partial:
            last = calls[-1]
            calls[-1] = Call(last.name, last.arguments + "}" if last.arguments else "{}")
        return Parsed(held("".join(r.content), partial, (RESPONSE,)), held(reasoning, partial), calls)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice: the thought channel (optional; empty channels
        before it, as llama.cpp consumes them), any text up to the first `<|tool_call>` (llama.cpp's
        parse skips it), then calls of the allowed tools (`choice`: "required" or that tool's name;
        back to back, several with parallel calls) with their arguments in Gemma's notation and
        its whitespace (after `{`, `[`, `,`, `:` and before the closing bracket), and the
        `<|tool_response>` the model writes after them, optional. Values are not
        typed by the schema: llama.cpp's grammar does not type them either. Markers are literals
        in rules, so that they can be named as the special tokens they are."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        names = " | ".join(json.dumps(n) for n in allowed)
        more = f" ({json.dumps(CALL)} call)*" if ctx.parallel else ""
        return "\n".join([
            f"start: thought? pre call{more} {json.dumps(RESPONSE)}?",
            f'thought: {json.dumps(CHANNEL)}+ "thought" thought_text',
            f'call: "call:" ({names}) dict {json.dumps(CALL_END)}',
            'dict: "{" WS? ("}" | kv ("," WS? kv)* WS? "}")',
            'kv: KEY ":" WS? value',
            'array: "[" WS? ("]" | value ("," WS? value)* WS? "]")',
            'value: string | dict | array | NUMBER | "true" | "false" | "null"',
            f"string: {json.dumps(QUOTE)} string_text",
            r"KEY: /[^:}\s][^:}]*/",
            r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
            r"WS: /[ \t\n\r\f\v]+/",
        ]) + "\n" + until_rule("thought_text", CLOSE) + until_rule("pre", CALL) + until_rule("string_text", QUOTE)


    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return (CALL,)


class _Reading:
    """One parse of a reply: messages (thought, content), then calls, as far as the text goes."""

    def __init__(self, text: str, ctx: Context) -> None:
        self.text, self.ctx = text, ctx
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []
        self.stops = (CHANNEL, CLOSE, CALL) if ctx.tools else (CHANNEL, CLOSE)

    def run(self) -> None:
        text, pos, n = self.text, 0, 0
        while pos < len(text):          # messages: thought? content
            got = self.message(pos)
            if got == MORE:
                return
            if got == FAIL or got == pos:
                break
            pos, n = got, n + 1
        if not self.ctx.tools:
            if n == 0 and pos < len(text):      # llama.cpp fails: the text stays content
                self.content.append(text[pos:])
            return
        start = pos
        pos, found = until(text, pos, CALL)     # llama.cpp skips this text; here it stays content
        self.content.append(text[start:pos])
        if not found:
            return
        while pos < len(text):
            got = self.call(pos)
            if got == MORE:
                return
            if got == FAIL or not self.ctx.parallel and got > 0:   # what is no call stays content
                rest = text[pos if got == FAIL else got:]
                self.content.append(rest[len(RESPONSE):] if rest.startswith(RESPONSE) else rest)
                return
            pos = got

    def message(self, pos: int) -> int:
        p = self.thought(pos)
        if p < 0:
            return p
        end, ended = until_any(self.text, p, self.stops)
        self.content.append(self.text[p:end])
        return end if ended else MORE

    def thought(self, pos: int) -> int:
        text = self.text
        if not text.startswith(CHANNEL, pos):
            return MORE if lit(text, pos, CHANNEL) == MORE and pos < len(text) else pos
        p = pos
        while text.startswith(CHANNEL, p):      # empty channels before the thought
            after = lit(text, p + len(CHANNEL), "thought")
            if after == MORE:
                return MORE
            if after > 0:
                break
            p += len(CHANNEL)
        start = p
        p = lit(text, p, THOUGHT)
        if p < 0:
            return p
        p = SPACE.match(text, p).end()
        end, ended = until(text, p, CLOSE)
        if self.ctx.extract_reasoning:
            self.reasoning.append(text[p:end])
            return lit(text, end, CLOSE) if ended else MORE
        close = lit(text, end, CLOSE) if ended else MORE
        self.content.append(text[start:close if close > 0 else len(text)])
        return close

    def call(self, pos: int) -> int:
        p = lit(self.text, pos, CALL + "call:")
        if p < 0:
            return p
        for name in self.ctx.tools:
            q = lit(self.text, p, name)
            if q == FAIL:
                continue
            if q == MORE or q == len(self.text):
                return MORE
            if self.text[q] != "{":
                continue
            return self.arguments(q, name)
        return FAIL

    def arguments(self, pos: int, name: str) -> int:
        members: list[str] = []         # the complete members so far
        end = _Values(self.text).items(pos, "{", "}", members)
        if end == FAIL:
            return FAIL
        args = "{" + ",".join(members)
        if end == MORE:     # given once closed: a value still to come may make it no call at all
            return MORE
        close = lit(self.text, end, CALL_END)
        if close == FAIL:
            return FAIL
        self.calls.append(Call(name, args + "}" if close > 0 else args, closed=close > 0))
        return close


class _Values:
    """Gemma's values read into JSON text. A method returns (json text, end), MORE or FAIL."""

    def __init__(self, text: str) -> None:
        self.text = text

    def value(self, pos: int):
        for kind in (self.string, self.dict, self.array, self.number, self.word):
            got = kind(pos)
            if got != FAIL:
                return got
        return FAIL

    def string(self, pos: int):
        p = lit(self.text, pos, QUOTE)
        if p < 0:
            return p
        end, ended = until(self.text, p, QUOTE)
        close = lit(self.text, end, QUOTE) if ended else MORE
        return close if close < 0 else (json.dumps(self.text[p:end], ensure_ascii=False), close)

    def dict(self, pos: int):
        members: list[str] = []
        got = self.items(pos, "{", "}", members)
        return got if got < 0 else ("{" + ",".join(members) + "}", got)

    def array(self, pos: int):
        items: list[str] = []
        got = self.items(pos, "[", "]", items)
        return got if got < 0 else ("[" + ",".join(items) + "]", got)

    def items(self, pos: int, open_: str, close: str, out: list[str]) -> int:
        """`{ kv, kv }` or `[ v, v ]` from `pos`, each item's JSON text added to `out` once read:
        where it ends, MORE or FAIL."""
        item = self.kv if open_ == "{" else self.value
        p = lit(self.text, pos, open_)
        if p < 0:
            return p
        p = SPACE.match(self.text, p).end()
        end = lit(self.text, p, close)
        if end != FAIL:
            return end
        while True:
            got = item(p)
            if got in (MORE, FAIL):
                return got
            out.append(got[0])
            p = got[1]
            q = lit(self.text, p, ",")
            if q == MORE:
                return MORE
            if q == FAIL:
                return lit(self.text, SPACE.match(self.text, p).end(), close)
            p = SPACE.match(self.text, q).end()

    def kv(self, pos: int):
        m = KEY.match(self.text, pos)
        if m is None:
            return MORE if pos >= len(self.text) else FAIL
        p = lit(self.text, m.end(), ":")
        if p < 0:
            return p
        got = self.value(SPACE.match(self.text, p).end())
        return got if got in (MORE, FAIL) else (json.dumps(m.group(), ensure_ascii=False) + ":" + got[0], got[1])

    def number(self, pos: int):
        m = NUMBER.match(self.text, pos)
        if m is None:
            return MORE if pos < len(self.text) and self.text[pos] == "-" and pos + 1 == len(self.text) else FAIL
        if NUMBER_TAIL.match(self.text, m.end()).end() == len(self.text):
            return MORE             # it may still go on
        if NUMBER_TAIL.match(self.text, m.end()).end() > m.end():
            return FAIL
        return m.group(), m.end()

    def word(self, pos: int):
        more = False
        for w in ("true", "false", "null"):
            p = lit(self.text, pos, w)
            if p > 0:
                return w, p
            more = more or p == MORE
        return MORE if more else FAIL
