"""OpenAI's harmony format (gpt-oss): a reply is a run of messages on channels.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary<|message|>PREAMBLE (content)<|end|>
    <|start|>assistant<|channel|>final<|message|>CONTENT
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{ARGS}

The generation prompt is `<|start|>assistant`, so a reply opens inside a message's header.
The analysis channel is the reasoning (several blocks are joined as they are), the commentary
channel without a recipient and the final channel are the content, a message to
`functions.NAME` is the call (one per reply: `<|call|>` ends generation). A message to any
other recipient (a built-in tool) is dropped, as llama.cpp drops it; `<|channel|>commentary
[to=assistant]` before a channel is a stray header models write and is skipped.

This reads the reply as llama.cpp's parser (common/parsers/gpt-oss.cpp, a PEG) does, step for
step: each marker is matched, failed, or still being written (the text ends inside it), and
nothing is trimmed. Where llama.cpp's parse fails (text that is no harmony message), the text
from that point on stays content, so no text is lost.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, closed_args, held, open_json
from .peg import FAIL, MORE, SPACE, TYPE, lit, until, until_rule

START, END, MESSAGE, CHANNEL = "<|start|>assistant", "<|end|>", "<|message|>", "<|channel|>"
STRAY = "<|channel|>commentary"

# the messages before the last one, and the pieces of a header (llama.cpp's rules of those names);
# each marker its own literal, so that a header is cut into the same lexemes in every rule
_MESSAGES = (
    'message: preamble | analysis\n'
    'preamble: "<|channel|>" "commentary" "<|message|>" body\n'
    'analysis: ("<|channel|>" "commentary" " to=assistant"?)? "<|channel|>" "analysis" "<|message|>" body\n'
    + until_rule("body", END) +
    'channel: "<|channel|>" ("commentary" | "analysis")\n'
    'constraint: /[ \\t\\n\\r\\f\\v]+/? "<|constrain|>"? /[A-Za-z0-9_-]+/\n')


class Harmony(Format):
    name: ClassVar[str] = "gpt-oss"
    think = None
    supports_thinking = True     # its own reasoning, read by parse

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<|channel|>" in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        r = _Reading(text, ctx)
        r.run()
        reasoning = "".join(r.reasoning)
        if not reasoning.strip(" \n\r\t"):
            reasoning = ""
        content = "".join(r.content)
        if r.calls and not r.calls[-1].closed and not partial:
            r.calls[-1] = Call(r.calls[-1].name, closed_args(r.calls[-1].arguments))
        return Parsed(held(content, partial), held(reasoning, partial), r.calls)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, as llama.cpp's grammar for it (gpt-oss.cpp):
        analysis (reasoning) and commentary preamble (content) messages, each ended by `<|end|>`
        and followed by the next `<|start|>assistant`, then one call (`<|call|>` ends the turn)
        of an allowed tool (`choice`: "required" or that tool's name), its recipient in the role
        header (` to=functions.NAME<|channel|>commentary json<|message|>`, the form the model
        writes) or after the channel (`<|channel|>commentary to=functions.NAME <|constrain|>json
        <|message|>`), on the commentary or analysis channel, with an optional content type, and
        the arguments as JSON of the tool's schema. The markers are literals in rules, so that
        they can be named as the special tokens they are (special_tokens.py)."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
        rules = [f"call_{i}: ({json.dumps(f' to=functions.{n}')} channel | channel {json.dumps(f' to=functions.{n}')})"
                 f" constraint? {json.dumps(MESSAGE)} %json {json.dumps(ctx.tools[n] or {'type': 'object'})}"
                 for i, n in enumerate(allowed)]
        return (f"start: (message {json.dumps(START)})* ({calls})\n" + _MESSAGES + "\n".join(rules) + "\n")

    def answer_grammar(self, schema_json: str | dict, ctx: Context | None = None) -> str:
        """The whole reply under a response format (a JSON schema), as llama.cpp's grammar for it:
        the schema applies to the answer, not to the reasoning. Analysis messages first, each
        followed by the next `<|start|>assistant`, then the final channel (an optional content
        type, `final <|constrain|>json`, as the model writes it) and the answer as JSON of the
        schema."""
        schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
        return (f'start: (analysis {json.dumps(START)})* "<|channel|>" "final" constraint? "<|message|>" '
                f"%json {json.dumps(schema)}\n" + _MESSAGES)


    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return ("to=functions.",)


class _Reading:
    """One parse of a reply: the messages in order, stopping where the text ends or fails."""

    def __init__(self, text: str, ctx: Context) -> None:
        self.text, self.ctx = text, ctx
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []

    def run(self) -> None:
        text, pos, first = self.text, 0, True
        while pos < len(text):          # (start (preamble | analysis))*
            p = pos if first else lit(text, pos, START)
            if p == MORE:
                return
            if p == FAIL:
                break
            got = self.preamble(p)
            if got == FAIL:
                got = self.analysis(p)
            if got == FAIL:
                break
            if got == MORE:
                return
            pos, first = got, False
        p = pos if first else lit(text, pos, START)   # start (tool call | final | unsolicited)
        if p == MORE:
            return
        got = FAIL if p == FAIL else self.last(p)
        if got == FAIL:                 # llama.cpp's parse fails here: the rest stays content
            self.content.append(text[pos:])

    def preamble(self, pos: int) -> int:
        p = lit(self.text, pos, f"{CHANNEL}commentary{MESSAGE}")
        return p if p < 0 else self.body(p, self.content)

    def body(self, pos: int, into: list[str]) -> int:
        end, ended = until(self.text, pos, END)
        into.append(self.text[pos:end])
        return lit(self.text, end, END) if ended else MORE

    def stray(self, pos: int) -> int:
        p = lit(self.text, pos, STRAY)
        if p == FAIL:
            return pos
        if p == MORE:
            return MORE
        q = lit(self.text, p, " to=assistant")
        return p if q == FAIL else q

    def analysis(self, pos: int) -> int:
        p = self.stray(pos)
        if p >= 0:
            p = lit(self.text, p, f"{CHANNEL}analysis{MESSAGE}")
        if p < 0:
            return p
        if self.ctx.extract_reasoning:
            return self.body(p, self.reasoning)
        got: list[str] = []
        end = self.body(p, got)
        self.content.append(self.text[pos:end if end >= 0 else len(self.text)])
        return end

    def last(self, pos: int) -> int:
        if self.ctx.tools:
            got = self.call(pos)
            if got != FAIL:
                return got
        got = self.final(pos)
        if got == FAIL and not self.ctx.tools:
            got = self.unsolicited(pos)
        return got

    def final(self, pos: int) -> int:
        p = self.stray(pos)
        if p >= 0:
            p = lit(self.text, p, f"{CHANNEL}final")
        if p >= 0:      # the response-format shape: `final <|constrain|>json`
            p = self.constraint(p)
        if p >= 0:
            p = lit(self.text, p, MESSAGE)
        if p < 0:
            return p
        end, _ = until(self.text, p, END)
        self.content.append(self.text[p:end])
        return end

    def unsolicited(self, pos: int) -> int:
        """A message to a recipient that is not one of the request's functions: dropped."""
        p = self.channel(pos)
        if p == MORE:
            return MORE
        p = lit(self.text, pos if p == FAIL else p, " to=")
        return p if p < 0 else len(self.text)

    def channel(self, pos: int) -> int:
        p = lit(self.text, pos, CHANNEL)
        if p < 0:
            return p
        q = lit(self.text, p, "commentary")
        return lit(self.text, p, "analysis") if q == FAIL else q

    def constraint(self, pos: int) -> int:
        """llama.cpp's optional `space [<|constrain|>] [A-Za-z0-9_-]+` after a header."""
        q = SPACE.match(self.text, pos).end()
        c = lit(self.text, q, "<|constrain|>")
        if c == MORE:
            return MORE
        m = TYPE.match(self.text, q if c == FAIL else c)
        if m.end() > m.start():
            return m.end()
        return MORE if m.end() >= len(self.text) else pos

    def call(self, pos: int) -> int:
        """` to=functions.NAME<|channel|>X[constraint]<|message|>` or `<|channel|>X to=functions.NAME
        [constraint]<|message|>`, then the arguments (a JSON object)."""
        for name in self.ctx.tools:
            for header in (self.in_role, self.in_channel):
                p = header(pos, name)
                if p >= 0:
                    p = self.constraint(p)
                if p >= 0:
                    p = lit(self.text, p, MESSAGE)
                if p >= 0:
                    return self.arguments(p, name)
                if p == MORE:
                    return MORE
        return FAIL

    def in_role(self, pos: int, name: str) -> int:
        p = lit(self.text, pos, f" to=functions.{name}")
        return p if p < 0 else self.channel(p)

    def in_channel(self, pos: int, name: str) -> int:
        p = self.channel(pos)
        return p if p < 0 else lit(self.text, p, f" to=functions.{name}")

    def arguments(self, pos: int, name: str) -> int:
        body = self.text[pos:]
        if not body.startswith("{"):
            if body:
                return FAIL
            self.calls.append(Call(name, "", closed=False))
            return MORE
        try:
            args, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            self.calls.append(Call(name, open_json(body), closed=False))
            return MORE
        if not isinstance(args, dict):
            return FAIL
        self.calls.append(Call(name, body[:end]))
        return pos + end
