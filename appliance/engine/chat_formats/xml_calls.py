"""Tool calls written as XML-like tags, one tag per argument, each family a row of marker strings:

    Qwen3-Coder, Qwen3.5, Nemotron 3 Nano, StepFun 3.5 (llama.cpp's qwen3_coder parser):
        <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    Seed-OSS:    <seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></seed:tool_call>
    MiniMax-M2:  <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...
                 </minimax:tool_call>
    GLM 4.6/4.7, Laguna, Ling 3:  <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>
    MiniCPM5:    <function name="NAME"><param name="KEY">VALUE</param></function>

A VALUE is typed by the tool's JSON schema (see `_typed`): text where the parameter is a string,
else JSON. Whitespace follows llama.cpp's grammars: the qwen3_coder rows write their newlines as
part of the markers (a value keeps every other character); the others allow any whitespace between
tags and keep a value's text as written. A reply is read the way llama.cpp's PEG parsers read it:
content up to the first call, then calls; a block that does not read as a call of the request's
tools ends the calls, and it and what follows stay content (llama.cpp's qwen3_coder parser drops
them, its automatic parser fails; a bad reply loses nothing here).
Streamed (partial), a call is given while open once its required arguments have all been read,
so that it can then fail to be a call only on an optional argument or its closing tag; its
arguments grow by whole arguments: `{"city": "Paris"`, then `{"city": "Paris", "days": 3`, then
closed. (A bad optional argument after that drops the call from the whole reply, as llama.cpp's
parse does, while the stream has named it, as llama-server's has.)
This class is the Qwen3.5 / Nemotron 3 / StepFun row; the others are in xml_rows.py, the grammar
that writes a row's calls in xml_grammar.py.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from .base import Call, Context, Format, Parsed, dump_args, held, partial_suffix, schema_types

_SPACE = re.compile(r"\s*")
_NAME_END = re.compile(r"[\s<]")
ALL = {"string", "number", "integer", "boolean", "null", "array", "object"}


class _More(Exception):
    """The text ends inside a call: more may come."""


class _Fail(Exception):
    """The text is not a call of the request's tools."""


class _Cursor:
    def __init__(self, text: str, pos: int, flex: bool) -> None:
        self.text, self.pos, self.flex = text, pos, flex
        self.pending: Call | None = None    # the open call, while it may still turn out not to be one

    def at(self, s: str) -> bool:
        """Whether `s` is next (raises _More where the text ends inside it)."""
        if self.text.startswith(s, self.pos):
            return True
        if len(self.text) - self.pos < len(s) and s.startswith(self.text[self.pos:]):
            raise _More
        return False

    def lit(self, s: str) -> None:
        if not self.at(s):
            raise _Fail
        self.pos += len(s)

    def ws(self, always: bool = False) -> None:
        if self.flex or always:
            self.pos = _SPACE.match(self.text, self.pos).end()

    def until(self, s: str) -> str:
        at = self.text.find(s, self.pos)
        if at < 0:
            raise _More
        out, self.pos = self.text[self.pos:at], at + len(s)
        return out


class XmlCalls(Format):
    """Calls as tags (the row's markers); see the module's docstring for the shapes."""
    name: ClassVar[str] = "qwen3_coder_thinking"
    prompt_think: ClassVar[str] = "<think>\n"     # what a prompt that opens thinking ends with
    think_ends_at_call: ClassVar[bool] = True       # a call closes an open thinking block
    bare_close: ClassVar[bool] = False              # a reply that does not think starts with the close
    open_ws: ClassVar[str | None] = None            # after <think>: None any whitespace, else these chars
    close_ws: ClassVar[str | None] = None           # after </think>: the same
    section: ClassVar[tuple[str, str] | None] = None    # one block around several calls
    wrap: ClassVar[tuple[str, str]] = ("<tool_call>\n", "</tool_call>")   # around each call
    call: ClassVar[tuple[str, str, str]] = ("<function=", ">\n", "</function>\n")  # name open, name close, close
    arg: ClassVar[tuple[str, str, str, str]] = ("<parameter=", ">\n", "", "\n</parameter>\n")
    flex: ClassVar[bool] = False          # whitespace allowed between tags
    string_wins: ClassVar[bool] = False   # a parameter that may be a string is always its text
    tail: ClassVar[str] = "content"       # after the calls: "content" (kept); "drop" (llama.cpp's way)
    bare_first: ClassVar[bool] = False    # the first call may come without its wrap (Qwen3-Coder)
    stop: ClassVar[str] = ""              # the reply ends at this (an end-of-turn spelled as text)
    cdata: ClassVar[tuple[str, str] | None] = None     # a string value may be wrapped in these (MiniCPM5)
    detect_all: ClassVar[tuple[str, ...]] = ("<tool_call>", "<function=", "<parameter=", "<think>")
    detect_none: ClassVar[tuple[str, ...]] = ("'<tool_call><function=' ~ tool_call.name ~ '>'",)

    @classmethod
    def detect(cls, src: str) -> bool:
        return all(m in src for m in cls.detect_all) and not any(m in src for m in cls.detect_none)

    def starts(self, ctx: Context) -> tuple[str, ...]:
        """The strings a call block starts with."""
        first = (self.section or self.wrap)[0] or self.call[0]
        if self.bare_first:
            return (first, *(f"{self.call[0]}{n}{self.call[1]}" for n in ctx.tools))
        return (first,)

    def triggers(self, ctx: Context) -> tuple[str, ...]:
        return self.starts(ctx)

    # --- reasoning and content ---------------------------------------------------------------------

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        if self.stop:
            at = text.find(self.stop)
            text = text[:at] if at >= 0 else text[: len(text) - (partial_suffix(text, (self.stop,)) if partial else 0)]
        starts = self.starts(ctx) if ctx.tools else ()
        reasoning, rest = self._reasoning(text, ctx, partial, starts)
        if not ctx.tools:
            return Parsed(held(rest, partial), reasoning)
        content, calls = self.calls(rest, ctx, partial)
        return Parsed(content, reasoning, calls)

    def _reasoning(self, text: str, ctx: Context, partial: bool, starts: tuple[str, ...]) -> tuple[str, str]:
        """(reasoning, the text after it), as llama.cpp's grammar reads the prompt's thinking tag
        and the reply: the reasoning's text between the tags as written (none if only whitespace),
        the whitespace the row names after each tag dropped."""
        if self.think and ctx.thinking_open:
            text = self.prompt_think + text
        at = _SPACE.match(text).end()
        if not self.think or not ctx.extract_reasoning:
            return "", text[at:]
        open_, close = self.think
        if not text.startswith(open_, at):
            if partial and text[at:] and open_.startswith(text[at:]):
                return "", ""
            return "", text[at:]
        at = _skip(text, at + len(open_), self.open_ws)
        ends = (close, *starts) if self.think_ends_at_call else (close,)
        hits = [(i, m) for m in ends if (i := text.find(m, at)) >= 0]
        if not hits:
            body = text[at:]
            return _visible(body[: len(body) - partial_suffix(body, ends)] if partial else body, partial), ""
        end, mark = min(hits)
        reasoning = _visible(text[at:end], False)
        if mark != close:
            return reasoning, text[end:]
        return reasoning, text[_skip(text, end + len(close), self.close_ws):]

    # --- calls -----------------------------------------------------------------------------------

    def calls(self, text: str, ctx: Context, partial: bool) -> tuple[str, list[Call]]:
        starts = self.starts(ctx)
        hits = [i for s in starts if (i := text.find(s)) >= 0]
        if not hits:    # a call's start cut off at the end is not content, as llama.cpp's `until`
            return held(text[: len(text) - partial_suffix(text, starts)], partial), []
        content, calls, pos, bare = text[: min(hits)], [], min(hits), self.bare_first
        while True:
            cur, n = _Cursor(text, pos, self.flex), len(calls)
            try:
                self._block(cur, ctx, calls, bare)
            except _More:   # the text ends inside a call: so far, it is one (llama.cpp's lenient parse)
                if partial:     # an open call is given once it can only end as a call (see _call)
                    calls[n:] = [c for c in calls[n:] if c is not cur.pending]
                    return held(content, partial), calls
                for c in calls[n:]:
                    if not c.closed:
                        c.arguments, c.closed = c.arguments + "}", True
                return held(content, partial), calls
            except _Fail:
                del calls[n:]
                break
            bare, pos = False, _SPACE.match(text, cur.pos).end()
            try:
                if not ctx.parallel or not _Cursor(text, pos, False).at(starts[0]):
                    break
            except _More:
                return held(content, partial), calls
        rest = text[pos:]
        if self.tail == "content" and rest.strip():
            content += rest
        return held(content, partial), calls

    def _block(self, cur: _Cursor, ctx: Context, calls: list[Call], bare: bool) -> None:
        """One block from the cursor on (a section of calls, or one call in its wrap), each call
        added to `calls` once named, its arguments as far as they are closed."""
        if not self.section:
            return self._wrapped(cur, ctx, calls, bare)
        cur.lit(self.section[0])
        cur.ws()
        self._wrapped(cur, ctx, calls, False)
        while True:     # past the first call, what is not one ends the section (llama.cpp fails there)
            at, n = cur.pos, len(calls)
            cur.ws()
            if cur.at(self.section[1]):
                cur.lit(self.section[1])
                return None
            try:
                if not ctx.parallel:
                    raise _Fail
                self._wrapped(cur, ctx, calls, False)
            except _Fail:
                del calls[n:]
                cur.pos = at
                return None

    def _wrapped(self, cur: _Cursor, ctx: Context, calls: list[Call], bare: bool) -> None:
        if not (bare and not cur.at(self.wrap[0])):
            cur.lit(self.wrap[0])
        cur.ws()
        self._call(cur, ctx, calls)
        cur.ws()
        cur.lit(self.wrap[1])

    def _call(self, cur: _Cursor, ctx: Context, calls: list[Call]) -> None:
        name_open, name_close, close = self.call
        cur.lit(name_open)
        if name_close:
            name = cur.until(name_close)
        else:
            m = _NAME_END.search(cur.text, cur.pos)
            if m is None:
                raise _More
            name, cur.pos = cur.text[cur.pos:m.start()], m.start()
        if name not in ctx.tools:
            raise _Fail
        end = close or self.wrap[1]
        if not name_close:      # a bare name is one once an argument or the close follows
            cur.ws()
            if not (cur.at(self.arg[0]) or cur.at(end)):
                raise _Fail
        need = set((ctx.tools[name] or {}).get("required") or ())
        args: dict[str, Any] = {}
        call = cur.pending = Call(name, "{", closed=False)
        calls.append(call)
        while True:
            cur.ws()
            if cur.at(end):
                break
            key, value = self._arg(cur, ctx, name)
            args[key] = value
            call.arguments = dump_args(args)[:-1]
            if need <= set(args):   # it can now fail only on an optional argument or its close
                cur.pending = None
        if need - set(args):
            raise _Fail
        if close:
            cur.lit(close)
        call.arguments, call.closed, cur.pending = dump_args(args), True, None

    def _arg(self, cur: _Cursor, ctx: Context, tool: str) -> tuple[str, Any]:
        key_open, key_close, value_open, _ = self.arg
        cur.lit(key_open)
        key = cur.until(key_close)
        props = (ctx.tools[tool] or {}).get("properties") or {}
        if key not in props:
            raise _Fail
        cur.ws()
        cur.lit(value_open)
        return key, self._typed(self._raw(cur), props[key])

    def _raw(self, cur: _Cursor) -> str:
        """A value's text, up to and past its closing tag."""
        return cur.until(self.arg[3])

    def _typed(self, raw: str, schema: Any) -> Any:
        """A value as llama.cpp types it: a string parameter is its text; one that may be a string
        is its text (string_wins) or else JSON of its other types; any other must be JSON."""
        types = schema_types(schema) or ALL
        if "string" in types and (self.string_wins or types == {"string"}):
            return raw
        try:
            value = json.loads(raw)
        except ValueError:
            if "string" in types:
                return raw
            raise _Fail from None
        if "string" in types and _kind(value) not in types and not (_kind(value) == "integer" and "number" in types):
            return raw
        return value

    # --- grammar ---------------------------------------------------------------------------------

    def grammar(self, ctx: Context, choice: str) -> str | None:
        from .xml_grammar import grammar
        return grammar(self, ctx, choice)


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "null")


def _skip(text: str, at: int, chars: str | None) -> int:
    """Past the whitespace after a tag: any (None), or each of `chars` in turn where it is next."""
    if chars is None:
        return _SPACE.match(text, at).end()
    for ch in chars:
        at += text.startswith(ch, at)
    return at


def _visible(text: str, partial: bool) -> str:
    """Reasoning as llama.cpp gives it: whitespace only is none; while partial, no trailing space."""
    if not text.strip():
        return ""
    return text.rstrip() if partial else text


