"""Functionary v3.2: every message goes to a recipient, `>>>RECIPIENT\\n` then its text.

    [generation prompt: <|start_header_id|>assistant<|end_header_id|>\\n\\n>>>]
    all\\nCONTENT
    get_weather\\n{"city": "Paris"}>>>add\\n{"a": 2}

The prompt ends with `>>>`, so a reply opens with its recipient: `all` is the user (content),
a function's name is a call with JSON arguments.

This reads the reply as llama.cpp's parser (common/parsers/functionary-v3-2.cpp) does, which
differs from the format in one place: it never reads a call after content (`all\\n...>>>f\\n{}`
is all content: the `>>>` is not consumed). llama.cpp fails on anything after a call (a second
`>>>` call, text); there this reads the format as it is meant, more calls and `>>>all` content,
and keeps other text as content, so no text is lost.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, closed_args, held, json_prefix, open_json
from .peg import FAIL, MORE, lit

ALL, NEXT = "all\n", ">>>"


class Functionary(Format):
    name: ClassVar[str] = "functionary-v3.2"
    think = None

    @classmethod
    def detect(cls, src: str) -> bool:
        return ">>>all" in src and ">>>${recipient}" in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        p = lit(text, 0, ALL)
        if p == MORE:
            return Parsed()
        if p > 0 or not ctx.tools:      # content to its end, `>>>` and all (without `all`, llama.cpp fails)
            return Parsed(held(text[max(p, 0):], partial))
        calls: list[Call] = []
        pos = 0
        while True:
            got = self._call(text, pos, ctx)
            if got == MORE:
                return Parsed("", "", calls)
            if got == FAIL:             # not a call: llama.cpp fails; the text stays content
                return Parsed(held(text[pos if calls else 0:], partial), "", calls)
            calls.append(got[0])
            pos = got[1]
            if not got[0].closed:
                if not partial:         # cut short: its members so far
                    calls[-1] = Call(got[0].name, closed_args(got[0].arguments))
                return Parsed("", "", calls)
            nxt = lit(text, pos, NEXT)
            if nxt == MORE:
                return Parsed("", "", calls)
            if nxt == FAIL:             # text after the call (llama.cpp fails): content
                return Parsed(held(text[pos:], partial), "", calls)
            after = lit(text, nxt, ALL)
            if after == MORE:
                return Parsed("", "", calls)
            if after > 0:
                return Parsed(held(text[after:], partial), "", calls)
            pos = nxt

    def _call(self, text: str, pos: int, ctx: Context):
        """`NAME\\n{json}` at `pos`: (the call, where it ends), MORE or FAIL."""
        for name in ctx.tools:
            p = lit(text, pos, name + "\n")
            if p == MORE:
                return MORE
            if p == FAIL:
                continue
            if p == len(text):
                return Call(name, "", closed=False), p
            if text[p] != "{":
                return FAIL
            got = json_prefix(text[p:])
            if got is None or got[1] == 0:
                return Call(name, open_json(text[p:]), closed=False), len(text)
            return Call(name, text[p:p + got[1]]), p + got[1]
        return FAIL

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice: calls of the allowed tools (`choice`: "required"
        or that tool's name), the first one's recipient right after the prompt's `>>>`, the next
        ones after their own `>>>` (with parallel calls), each `NAME\\n` and its arguments as JSON
        of the tool's schema. No reasoning, and no content before the calls: neither llama.cpp's
        parse nor this one reads a call after `all\\n` content."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules = [f"call_{i}: {json.dumps(n + chr(10))} %json {json.dumps(ctx.tools[n] or {'type': 'object'})}"
                 for i, n in enumerate(allowed)]
        more = f" ({json.dumps(NEXT)} call)*" if ctx.parallel else ""
        return "\n".join([f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(allowed))),
                          *rules]) + "\n"
