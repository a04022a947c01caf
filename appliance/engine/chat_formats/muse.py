"""Muse Glimmer: a reply is messages to recipients, calls in ATEM markup.

    [generation prompt: <|start|>assistant]
     to=self<|message|>REASONING<|eom|><|start|>assistant to=user<|message|>CONTENT<|eot|>
     to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|><|start|>assistant to=add<|message|>...

A parameter whose schema may be a string is its text; any other is JSON. The recipient of a
call's message is not checked: the invoke's name is the call's.

This reads the reply as llama.cpp's parser (common/parsers/muse-glimmer.cpp, a PEG) does:
nothing is trimmed; what follows the last message it reads is dropped. Where llama.cpp's parse
fails (a call of an unknown tool, a message that is no message), the text from that point on
stays content, so no text is lost.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, held, json_prefix, schema_types
from .peg import FAIL, MORE, SPACE, lit, until, until_any, until_rule

START, EOM, EOT, MESSAGE = "<|start|>assistant", "<|eom|>", "<|eot|>", "<|message|>"
SELF, USER = " to=self<|message|>", " to=user"
CALLS, INVOKE, INVOKE_END, CALLS_END = "<atem:function_calls>", '<atem:invoke name="', "</atem:invoke>", \
    "</atem:function_calls>"
PARAM, PARAM_END = '<atem:parameter name="', "</atem:parameter>"


class Muse(Format):
    name: ClassVar[str] = "muse-glimmer"
    think = None

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<atem:function_calls>" in src and "<|eom|>" in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        if not ctx.extract_reasoning and not ctx.tools:
            return Parsed(held(text, partial))
        r = _Reading(text, ctx)
        r.run()
        reasoning = "".join(r.reasoning)
        if not reasoning.strip(" \n\r\t"):
            reasoning = ""
        if r.calls and not r.calls[-1].closed and not partial:
            r.calls[-1] = Call(r.calls[-1].name, r.calls[-1].arguments + "}")
        return Parsed(held("".join(r.content), partial), held(reasoning, partial), r.calls)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, as llama.cpp's grammar for it (muse-glimmer.cpp)
        and this parse read it: messages to `self` (reasoning), each ended by `<|eom|>` and
        followed by the next `<|start|>assistant`; a message to the user (content, optional) ended
        by `<|eom|>`; then a call (or several, one message each, with parallel calls) of an
        allowed tool (`choice`: "required" or that tool's name): the recipient as written, the
        ATEM markup with its whitespace, each of the tool's parameters in any order (one that may
        be a string as text up to its closer, any other as JSON of its schema). Markers are
        literals in rules (special tokens)."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules = []
        for i, n in enumerate(allowed):
            args = []
            for key, schema in ((ctx.tools[n] or {}).get("properties") or {}).items():
                value = "text" if "string" in schema_types(schema) else \
                    f"%json {json.dumps(schema or {})} {json.dumps(PARAM_END)}"
                args.append(f"{json.dumps(PARAM)} {json.dumps(key + chr(34) + '>')} {value}")
            if args:
                rules.append(f"arg_{i}: " + " | ".join(args))
            body = f" (arg_{i} WS?)*" if args else ""
            rules.append(f'call_{i}: {json.dumps(INVOKE)} {json.dumps(n + chr(34) + ">")} WS?{body} {json.dumps(INVOKE_END)}')
        more = f" ({json.dumps(EOM)} {json.dumps(START)} call)*" if ctx.parallel else ""
        return "\n".join([
            f"start: (analysis {json.dumps(START)})* (final {json.dumps(START)})? call{more}",
            f'analysis: " to=" "self" {json.dumps(MESSAGE)} body',
            f'final: (" to=" "user")? {json.dumps(MESSAGE)} body',
            f'call: " to=" RECIPIENT? {json.dumps(MESSAGE)} {json.dumps(CALLS)} WS? (' + " | ".join(f"call_{i}" for i in range(len(allowed)))
            + f") WS? {json.dumps(CALLS_END)}",
            *rules,
            r"WS: /[ \t\n\r]+/",
            # a call's recipient: text up to <|message|> (llama.cpp's until), a name in practice;
            # not `self` or `user`, which open the other messages
            r"RECIPIENT: /[^<]+/ & ~/self|user/",
        ]) + "\n" + until_rule("body", EOM) + until_rule("text", PARAM_END)


    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return (CALLS,)


class _Reading:
    """One parse: messages to self (reasoning), then calls or the answer, as far as the text goes."""

    def __init__(self, text: str, ctx: Context) -> None:
        self.text, self.ctx = text, ctx
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []

    def run(self) -> None:
        text, pos, first = self.text, 0, True
        while pos < len(text):                  # (start analysis)*
            p = pos if first else lit(text, pos, START)
            if p == MORE:
                return
            got = FAIL if p == FAIL else self.analysis(p)
            if got == MORE:
                return
            if got == FAIL:
                break
            pos, first = got, False
        p = pos if first else lit(text, pos, START)
        if p == MORE:
            return
        got = FAIL if p == FAIL else self.last(p)
        if got == FAIL:                         # llama.cpp fails here: the rest stays content
            self.content.append(text[pos:])

    def analysis(self, pos: int) -> int:
        p = lit(self.text, pos, SELF)
        if p < 0:
            return p
        end, ended = until(self.text, p, EOM)
        (self.reasoning if self.ctx.extract_reasoning else self.content).append(self.text[p:end])
        return lit(self.text, end, EOM) if ended else MORE

    def last(self, pos: int) -> int:
        if self.ctx.tools:
            got = self.calls_from(pos)
            if got != FAIL:
                return got
        p = lit(self.text, pos, USER)
        p = pos if p == FAIL else p
        if p >= 0:
            p = lit(self.text, p, MESSAGE)
        if p < 0:
            return p
        end, ended = until_any(self.text, p, (EOT, EOM))
        self.content.append(self.text[p:end])
        if not ended or not self.ctx.tools:
            return MORE if not ended else end
        q = lit(self.text, end, EOM)            # calls after the answer
        if q >= 0:
            q = lit(self.text, q, START)
        if q < 0:
            return end if q == FAIL else MORE
        got = self.calls_from(q)
        return end if got == FAIL else got

    def calls_from(self, pos: int) -> int:
        got = self.call(pos)
        while got >= 0 and self.ctx.parallel:
            p = lit(self.text, got, EOM)
            if p >= 0:
                p = lit(self.text, p, START)
            if p < 0:
                return got if p == FAIL else MORE
            nxt = self.call(p)
            if nxt == FAIL:
                return got
            got = nxt
        return got

    def call(self, pos: int) -> int:
        p = lit(self.text, pos, " to=")
        if p < 0:
            return p
        end, ended = until(self.text, p, MESSAGE)
        if not ended:
            return MORE
        p = lit(self.text, end, MESSAGE + CALLS)
        if p >= 0:
            p = lit(self.text, SPACE.match(self.text, p).end(), INVOKE)
        if p < 0:
            return p
        for name, params in self.ctx.tools.items():
            q = lit(self.text, p, name + '">')
            if q == MORE:
                return MORE
            if q == FAIL:
                continue
            call = Call(name, "{", closed=False)
            self.calls.append(call)
            got = self.arguments(SPACE.match(self.text, q).end(), (params or {}).get("properties") or {}, call)
            if got != FAIL:
                return got
            self.calls.pop()
            return FAIL
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
            call.arguments, p = "{" + ",".join(members), SPACE.match(self.text, got[1]).end()
        p = lit(self.text, SPACE.match(self.text, p).end(), INVOKE_END)
        if p >= 0:
            p = lit(self.text, SPACE.match(self.text, p).end(), CALLS_END)
        if p > 0:
            call.arguments, call.closed = "{" + ",".join(members) + "}", True
        return p

    def argument(self, pos: int, props: dict):
        p = lit(self.text, pos, PARAM)
        if p < 0:
            return p
        for key, schema in props.items():
            q = lit(self.text, p, key + '">')
            if q == MORE:
                return MORE
            if q == FAIL:
                continue
            if "string" in schema_types(schema):
                end, ended = until(self.text, q, PARAM_END)
                value = json.dumps(self.text[q:end], ensure_ascii=False)
            else:
                got = json_prefix(self.text[q:]) if not self.text[q:q + 1].isspace() else None
                if got is None:     # cut short, or wrong once its closer is there
                    return FAIL if self.text.find(PARAM_END, q) >= 0 else MORE
                end, ended, value = q + got[1], True, self.text[q:q + got[1]]
            close = lit(self.text, end, PARAM_END) if ended else MORE
            return close if close < 0 else (f"{json.dumps(key)}:{value}", close)
        return FAIL

