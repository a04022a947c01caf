"""Python-style calls (Liquid's LFM2 and LFM2.5): a list of calls between two markers.

    <think>REASONING</think>CONTENT<|tool_call_start|>[get_time(city="Paris"), toggle(on=True)]<|tool_call_end|>

Arguments are keyword arguments with Python literals (strings in either quote, numbers, True,
False, None, lists, dicts; JSON's true/false/null too). A parameter the schema types as a string
must be a quoted string. Reasoning is read only from the template that writes <think> (LFM2.5
8B-A1B); the others keep it as content. One call list ends the reply.

This reads the reply as llama.cpp's parser (common/parsers/lfm2.cpp with
python_style_tool_calls in chat-peg-parser.cpp) does: nothing is trimmed, an argument's value is
turned into JSON as llama.cpp turns it (quotes to JSON's, True/False/None to JSON's words).
Where llama.cpp's parse fails, no text is lost: after a malformed list (a call of an unknown
tool, say) the text after the reasoning stays content; text after a good list is content too.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from .base import Call, Context, Format, Parsed, held
from .peg import FAIL, MORE, SPACE, lit, until, until_rule

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
THINK = ("<think>", "</think>")
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")
STRING_BODY = {'"': re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'),
               "'": re.compile(r"(?:[^'\\]|\\['\\/bfnrt]|\\u[0-9a-fA-F]{4})*")}
PARTIAL_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?")
WORDS = ("True", "False", "None", "true", "false", "null")


class Pythonic(Format):
    """LFM2 (`<|tool_list_start|>` in the template) and LFM2.5 (`List of tools: [`)."""
    name: ClassVar[str] = "lfm2"
    think = None
    reasons: ClassVar[bool] = False         # the template writes <think> blocks

    @classmethod
    def detect(cls, src: str) -> bool:
        lfm2 = "<|tool_list_start|>" in src and "<|tool_list_end|>" in src
        lfm25 = "List of tools: [" in src and "<|tool_list_start|>" not in src
        return (lfm2 or lfm25) and (THINK[0] in src) == cls.reasons

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        reasoning, pos = "", 0
        if self.reasons and ctx.extract_reasoning:
            p = lit(text, 0, THINK[0])
            if p == MORE:
                return Parsed()
            if p > 0:
                end, ended = until(text, p, THINK[1])
                reasoning = text[p:end] if text[p:end].strip(" \n\r\t") else ""
                pos = lit(text, end, THINK[1]) if ended else MORE
                if pos == MORE:
                    return Parsed("", held(reasoning, partial))
        content, calls = self._rest(text, pos, ctx, partial)
        return Parsed(held(content, partial), held(reasoning, partial), calls)

    def _rest(self, text: str, pos: int, ctx: Context, partial: bool) -> tuple[str, list[Call]]:
        if not ctx.tools:
            return text[pos:], []
        at, found = until(text, pos, OPEN)
        if not found:
            return text[pos:at], []
        calls: list[Call] = []
        end = _Calls(text, ctx, calls).block(at)
        if end == FAIL:                 # llama.cpp fails: all of it is content
            return text[pos:], []
        if calls and not calls[-1].closed and not partial:
            calls[-1] = Call(calls[-1].name, calls[-1].arguments + "}")
        # text after the list: llama.cpp fails on it; the calls stand and the text is content
        return text[pos:at] + (text[end:] if end >= 0 else ""), calls

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, as llama.cpp's grammar for it (lfm2.cpp and
        python_style_tool_calls): the <think> block where the template writes one (optional),
        any text up to `<|tool_call_start|>`, then one call list of the allowed tools (`choice`:
        "required" or that tool's name; one call, or several with parallel calls) and
        `<|tool_call_end|>`. A call's keyword arguments are its tool's properties, in any order,
        at least one where it has any; a parameter the schema types as a string takes a quoted
        string, any other a Python or JSON literal (llama.cpp does not type those either). The
        whitespace is llama.cpp's: after `[`, `(`, `,`, `:`, before `)` and `]`, and after a
        list or dict."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules = []
        for i, n in enumerate(allowed):
            props = (ctx.tools[n] or {}).get("properties") or {}
            args = " | ".join(f'{json.dumps(k + "=")} {"string" if isinstance(v, dict) and v.get("type") == "string" else "value"}'
                              for k, v in props.items())
            body = f' arg_{i} ("," WS? arg_{i})*' if args else ""
            rules.append(f'call_{i}: {json.dumps(n + "(")} WS?{body}{" WS?" if args else ""} ")"')
            if args:
                rules.append(f"arg_{i}: {args}")
        calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
        more = ' ("," WS? call)*' if ctx.parallel else ""
        think = ""
        if self.reasons and ctx.extract_reasoning:
            think = f"({json.dumps(THINK[0])} thought)? "
        return "\n".join([
            f'start: {think}pre "[" WS? call{more} WS? "]" {json.dumps(CLOSE)}',
            f"call: {calls}", *rules,
            'value: string | NUMBER | "True" | "False" | "None" | "true" | "false" | "null" | list | dict',
            'list: "[" WS? ("]" | value ("," WS? value)* WS? "]") WS?',
            'dict: "{" WS? ("}" | member (WS? "," WS? member)* WS? "}") WS?',
            'member: string WS? ":" WS? value',
            "string: DQ | SQ",
            r"""DQ: /"([^"\\]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/""",
            r"""SQ: /'([^'\\]|\\['\\\/bfnrt]|\\u[0-9a-fA-F]{4})*'/""",
            r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
            r"WS: /[ \t\n\r\f\v]+/",
        ]) + "\n" + until_rule("pre", OPEN, THINK[0] if think else "") + (until_rule("thought", THINK[1]) if think else "")


    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return (OPEN,)


class PythonicThinking(Pythonic):
    """LFM2.5 8B-A1B: the same calls, after a <think> block."""
    name = "lfm2-thinking"
    reasons = True
    supports_thinking = True     # its own reasoning, read by parse


class _Calls:
    """`[name(k=v, ...), ...]<|tool_call_end|>` read as llama.cpp reads it. Each method returns
    where what it read ends, MORE (the text ends inside it) or FAIL."""

    def __init__(self, text: str, ctx: Context, out: list[Call]) -> None:
        self.text, self.ctx, self.out = text, ctx, out

    def space(self, pos: int) -> int:
        return SPACE.match(self.text, pos).end()

    def block(self, pos: int) -> int:
        p = lit(self.text, pos, OPEN + "[")
        if p < 0:
            return p
        p = self.call(self.space(p))
        while p >= 0 and self.ctx.parallel:
            q = lit(self.text, p, ",")
            if q == FAIL:
                break
            p = q if q < 0 else self.call(self.space(q))
        if p < 0:
            return p
        return lit(self.text, self.space(p), "]" + CLOSE)

    def call(self, pos: int) -> int:
        for name, params in self.ctx.tools.items():
            p = lit(self.text, pos, name + "(")
            if p == FAIL:
                continue
            if p == MORE:
                return MORE
            call = Call(name, "{", closed=False)
            self.out.append(call)
            end = self.arguments(self.space(p), params or {}, call)
            if end != FAIL:
                return end
            self.out.pop()
        return FAIL

    def arguments(self, pos: int, params: dict, call: Call) -> int:
        props = params.get("properties") or {}
        members: list[str] = []
        p = pos
        while props:
            got = self.argument(p, props)
            if got in (MORE, FAIL):
                return got
            members.append(got[0])
            call.arguments = "{" + ", ".join(members)
            q = lit(self.text, got[1], ",")
            p = got[1]
            if q < 0:
                if q == MORE:
                    return MORE
                break
            p = self.space(q)
        end = lit(self.text, self.space(p), ")")
        if end > 0:
            call.arguments, call.closed = "{" + ", ".join(members) + "}", True
        return end

    def argument(self, pos: int, props: dict):
        for key, schema in props.items():
            p = lit(self.text, pos, key + "=")
            if p == FAIL:
                continue
            if p == MORE:
                return MORE
            string = isinstance(schema, dict) and schema.get("type") == "string"
            end = self.string(p) if string else self.value(p)
            if end == FAIL:
                continue
            if end == MORE:
                return MORE
            return f"{json.dumps(key)}: {_json(self.text[p:end])}", end
        return FAIL

    def value(self, pos: int) -> int:
        for kind in (self.dict, self.list, self.string, self.number, self.word):
            got = kind(pos)
            if got != FAIL:
                return got
        return FAIL

    def string(self, pos: int) -> int:
        if pos >= len(self.text):
            return MORE
        q = self.text[pos]
        if q not in STRING_BODY:
            return FAIL
        end = STRING_BODY[q].match(self.text, pos + 1).end()
        rest = self.text[end:]
        if not rest or PARTIAL_ESCAPE.fullmatch(rest):
            return MORE
        return end + 1 if rest[0] == q else FAIL

    def number(self, pos: int) -> int:
        m = NUMBER.match(self.text, pos)
        if m is None:
            return MORE if pos == len(self.text) - 1 and self.text[pos] == "-" else FAIL
        tail = NUMBER_TAIL.match(self.text, m.end()).end()
        return MORE if tail == len(self.text) else FAIL if tail > m.end() else m.end()

    def word(self, pos: int) -> int:
        got = [lit(self.text, pos, w) for w in WORDS]
        return next((p for p in got if p > 0), MORE if MORE in got else FAIL)

    def dict(self, pos: int) -> int:
        return self._items(pos, "{", "}", self._member, True)

    def list(self, pos: int) -> int:
        return self._items(pos, "[", "]", self.value, False)

    def _member(self, pos: int) -> int:
        p = self.string(pos)
        if p >= 0:
            p = lit(self.text, self.space(p), ":")
        return p if p < 0 else self.value(self.space(p))

    def _items(self, pos: int, open_: str, close: str, item, space_before_comma: bool) -> int:
        p = lit(self.text, pos, open_)
        if p < 0:
            return p
        p = self.space(p)
        end = lit(self.text, p, close)
        if end == FAIL:
            while True:
                p = item(p)
                if p < 0:
                    return p
                q = lit(self.text, self.space(p) if space_before_comma else p, ",")
                if q == MORE:
                    return MORE
                if q == FAIL:
                    break
                p = self.space(q)
            end = lit(self.text, self.space(p), close)
        return end if end < 0 else self.space(end)


def _json(value: str) -> str:
    """A Python literal's text as JSON text, as llama.cpp's normalize_quotes_to_json writes it."""
    out, quote, i = [], "", 0
    while i < len(value):
        c = value[i]
        if c == "\\" and quote:
            nxt = value[i + 1]
            out.append("'" if quote == "'" and nxt == "'" else c + nxt)
            i += 2
            continue
        if c in "\"'" and (not quote or quote == c):
            quote = "" if quote else c
            out.append('"')
        elif c == '"':
            out.append('\\"')
        elif not quote and c in "TFN" and (i == 0 or not (value[i - 1].isalnum() or value[i - 1] == "_")):
            word = re.match(r"\w*", value[i:]).group()
            out.append({"True": "true", "False": "false", "None": "null"}.get(word, word))
            i += len(word)
            continue
        else:
            out.append(c)
        i += 1
    text = "".join(out)
    try:
        json.loads(text)
    except ValueError:
        return _fallback(value)
    return text


def _fallback(value: str) -> str:
    import ast
    try:
        obj: Any = ast.literal_eval(value.strip())
        return json.dumps(obj, ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return json.dumps(value)
