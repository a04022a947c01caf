"""Kimi K2's calls, as llama.cpp reads them (common/parsers/kimi-k2.cpp):

    <think>reasoning</think>content<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...
    <|tool_calls_section_end|>

A call's id is the format's own, `functions.f:0` (Call.id). Reasoning is read only where the
reply begins with <think>; it ends at </think> or at the first call.
"""
from __future__ import annotations

import re
from typing import ClassVar

from .base import Call, Context, Format, Parsed
from .json_grammar import Lark, allowed, args, q
from .jsoncalls import AutoJson, Cursor, Fail, Short, closed_args, held_text

SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
CALL, ARGS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK = ("<think>", "</think>")
DIGITS = re.compile(r"[0-9]+")


class KimiK2(Format):
    name: ClassVar[str] = "kimi-k2"
    think = THINK
    markers = (SECTION[0], CALL)

    @classmethod
    def detect(cls, src: str) -> bool:
        return SECTION[0] in src and CALL in src

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        cur, out = Cursor(text), Parsed()
        if ctx.extract_reasoning:
            try:
                if cur.lit(THINK[0]):
                    body, found = cur.until(THINK[1], SECTION[0], CALL)
                    out.reasoning = held_text(body, partial and not found, (THINK[1], SECTION[0], CALL))
                    if not found:
                        return out
                    cur.lit(THINK[1])
            except Short:
                return out
        if not ctx.tools:
            out.content = held_text(text[cur.pos:], partial)
            return out
        body, found = cur.until(*self.markers)
        out.content = held_text(body, partial and not found, self.markers)
        if found:
            self._calls(cur, ctx, partial, out)
        return out

    def _calls(self, cur: Cursor, ctx: Context, partial: bool, out: Parsed) -> None:
        start, calls = cur.pos, []
        cur.call = None
        try:
            cur.lit(SECTION[0])
            while cur.pos < len(cur.src) and (ctx.parallel or not calls):
                if not cur.lit(CALL):
                    break
                calls.append(self._call(cur, ctx))
                cur.call = None
            cur.lit(SECTION[1])
            if cur.pos < len(cur.src):
                raise Fail
        except Fail:
            out.content += held_text(cur.src[start:], partial)
            return
        except Short:
            if cur.call is not None:
                if not partial:
                    cur.call.arguments = closed_args(cur.call.arguments)
                calls.append(cur.call)
            elif not partial and not calls:
                out.content += cur.src[start:]
        out.calls.extend(calls)

    def _call(self, cur: Cursor, ctx: Context) -> Call:
        cur.need("functions.")
        names = [n for n in ctx.tools if cur.src.startswith(n + ":", cur.pos)]
        rest = cur.src[cur.pos:]
        if not names:
            if any((n + ":").startswith(rest) for n in ctx.tools):
                raise Short
            raise Fail
        name = names[0]
        at = cur.pos
        cur.pos += len(name) + 1
        m = DIGITS.match(cur.src, cur.pos)
        if m is None or m.end() >= len(cur.src):
            raise Short if m is not None or cur.pos >= len(cur.src) else Fail
        cur.pos = m.end()
        ident = "functions." + cur.src[at:cur.pos]
        cur.need(ARGS)
        cur.call = Call(name, "", closed=False, id=ident)
        args = AutoJson._args(AutoJson(), cur)
        cur.lit(END)
        return Call(name, args, id=ident)


    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice (json_grammar.py's contract), as llama.cpp's
        kimi-k2.cpp writes it: <think> reasoning up to </think> or the first call, content up to
        the calls, the section's markers and each call's end optional."""
        names = allowed(ctx.tools, choice)
        if not names:
            return None
        g = Lark()
        g.choice("call", [f"{q(f'functions.{n}:')} /[0-9]+/ {q(ARGS)} {args(ctx.tools[n])} {q(END)}?" for n in names])
        after_call = f"call ({q(CALL)} call)* {q(SECTION[1])}?" if ctx.parallel else f"call {q(SECTION[1])}?"
        g.add("after_call", after_call)
        g.add("after_section", f"{q(CALL)} after_call")
        avoid = THINK[0] if ctx.extract_reasoning else ""
        said = f"{g.upto(SECTION[0], avoid)} after_section | {g.upto(CALL, avoid)} after_call"
        if not ctx.extract_reasoning:
            return g.text(said)
        g.add("thought", f"{g.upto(THINK[1])} said | {g.upto(SECTION[0])} after_section | {g.upto(CALL)} after_call")
        g.add("said", f"{g.upto(SECTION[0])} after_section | {g.upto(CALL)} after_call")
        return g.text(f"{q(THINK[0])} thought | {said}")


FAMILIES = [KimiK2]
