"""Calls whose arguments are a JSON object, read as llama.cpp's automatic parser reads them
(common/chat-auto-parser-generator.cpp, standard_json_tools in chat-peg-parser.cpp): the
families that differ only in markers and keys are rows of `AutoJson`, each the analysis llama.cpp
makes of its template (section, per-call, name and id markers; reasoning and content markers).

    json rows:  SECTION [ {"name": "f", "arguments": {...}}, ... ] SECTION_END   (keys, their order,
                an optional id key, {"f": {...}} with name_is_key, the [...] list: per row)
    tag rows:   SECTION PER_CALL PREFIX f SUFFIX [CALL_ID id SEP] {...} CLOSE PER_CALL_END ...

An optional reasoning block comes first (`reasoning`: its start and end as the template writes
them), then content up to the first call marker. As in llama.cpp, content and reasoning keep
their whitespace (only the reply's leading whitespace is skipped, where llama.cpp's parser skips
it), and a thinking block the generation prompt opened is read as `opened` + the reply, as
llama.cpp prepends the generation prompt. Where llama.cpp throws on a reply (text after the
calls, a call of no known tool, a missing key), what could not be read stays content.
"""
from __future__ import annotations

import json
from typing import Any, Callable, ClassVar

from .base import Call, Context, Format, Parsed, open_json
from .json_grammar import row_grammar
from .jsonscan import (SPACE, Cursor, Fail, Short, closed_args, colon, first_of, held_text, need_colon,
                       optional_id, space_lit, tools_named)

__all__ = ["AutoJson", "SPACE", "Cursor", "Fail", "Short", "closed_args", "held_text"]

class AutoJson(Format):
    """A template's reply format as llama.cpp's automatic parser analyses it: one row a template."""
    name: ClassVar[str] = "auto-json"
    needles: ClassVar[tuple[str, ...]] = ()       # all in the template's source: this row
    reasoning: ClassVar[tuple[str, str] | None] = None
    opened: ClassVar[str | None] = None           # the generation prompt's open thinking (default: its start)
    wrap: ClassVar[tuple[str, str] | None] = None  # content always between these
    tools: ClassVar[str | None] = "json"           # "json", "tag", or None: the template writes no calls
    section: ClassVar[tuple[str, str]] = ("", "")
    per_call: ClassVar[tuple[str, str]] = ("", "")
    array: ClassVar[bool] = False                  # json: the calls are a [...] list
    order: ClassVar[tuple[str, ...]] = ("name", "arguments")   # json: the keys, in order
    id_keys: ClassVar[tuple[str, ...]] = ()        # json: keys of `order` holding an optional id
    name_is_key: ClassVar[bool] = False            # json: {"f": {...}}
    openai_wrapper: ClassVar[bool] = False         # json: an optional leading "type": "function",
    name_prefix: ClassVar[str] = ""                # tag: around the name
    name_suffix: ClassVar[str] = ""
    call_id: ClassVar[tuple[str, str] | None] = None   # tag: optional (prefix id) then suffix
    close: ClassVar[str] = ""                      # tag: after the arguments

    NAME_KEYS: ClassVar[tuple[str, ...]] = ("name", "tool_name")

    @property
    def reads_calls(self) -> bool:   # a row of a template that writes no calls reads none
        return self.tools is not None

    @classmethod
    def detect(cls, src: str) -> bool:
        return bool(cls.needles) and all(n in src for n in cls.needles)

    @property
    def think(self) -> tuple[str, str] | None:     # type: ignore[override]
        return tuple(m.strip(SPACE) for m in self.reasoning) if self.reasoning else None  # type: ignore[return-value]

    @property
    def tool_start(self) -> str:
        return self.section[0] or self.per_call[0] or ("{" if self.tools == "json" else "")

    @property
    def markers(self) -> tuple[str, ...]:          # type: ignore[override]
        return (self.tool_start,) if self.tool_start else ()

    def _opened(self) -> str:
        return self.opened if self.opened is not None else (self.reasoning[0] if self.reasoning else "")

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return bool(self.reasoning) and prompt.rstrip(SPACE).endswith(self._opened().rstrip(SPACE))

    # --- the reply -------------------------------------------------------------------------

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        src = self._opened() + text if ctx.thinking_open and self.reasoning else text
        cur, out = Cursor(src), Parsed()
        calling = bool(ctx.tools) and self.tools is not None
        if calling or self.reasoning:
            cur.space()
        if self.reasoning and ctx.extract_reasoning:
            done, out.reasoning = self._reasoning(cur, partial)
            if done:
                return out
        if calling:
            self._with_calls(cur, ctx, partial, out)
        else:
            self._content_only(cur, ctx, partial, out)
        return out

    def _reasoning(self, cur: Cursor, partial: bool) -> tuple[bool, str]:
        """(whether the reply ends inside it, the reasoning) of an optional leading block."""
        start, end = self.reasoning or ("", "")
        try:
            if not cur.optspace(start):
                return False, ""
        except Short:
            return partial, ""
        close = end.strip(SPACE)
        body, found = cur.until(close)
        if not found:
            body = held_text(body, partial, (close,))
            return True, body if body.strip(SPACE) else ""
        try:
            cur.optspace(end)
        except Short:
            pass
        return False, body if body.strip(SPACE) else ""

    def _content_only(self, cur: Cursor, ctx: Context, partial: bool, out: Parsed) -> None:
        src = cur.src
        if not self.wrap:
            out.content = held_text(src[cur.pos:], partial)
            return
        start, end = self.wrap
        before = ""
        if not (self.reasoning and ctx.extract_reasoning):
            before, found = cur.until(start)
            if not found:
                out.content = held_text(before, partial, (start,))
                return
        at = cur.pos
        try:
            if not cur.lit(start):
                out.content = held_text(src[at:], partial)          # llama.cpp throws
                return
        except Short:
            out.content = before if partial else before + src[at:]
            return
        body, found = cur.until(end)
        out.content = before + held_text(body, partial and not found, (end,))
        if found:
            out.content += held_text(src[cur.pos + len(end):], partial)   # after it: llama.cpp throws

    def _with_calls(self, cur: Cursor, ctx: Context, partial: bool, out: Parsed) -> None:
        src = cur.src
        if self.wrap and self.tools == "json":
            start, end = self.wrap
            try:
                if cur.lit(start):
                    body, found = cur.until(end)
                    out.content = held_text(body, partial and not found, (end,))
                    if not found:
                        return
                    cur.pos += len(end)
            except Short:
                if not partial:
                    out.content = src[cur.pos:]
                return
        else:
            out.content, found = cur.until(self.tool_start)
            if not found:
                out.content = held_text(out.content, partial, (self.tool_start,))
                return
        begin = cur.pos
        mark = [begin, 0]

        def checkpoint() -> None:
            mark[:] = [cur.pos, len(out.calls)]
        try:
            (self._json_sections if self.tools == "json" else self._tag_sections)(cur, ctx, out, checkpoint)
            if cur.pos < len(src):
                checkpoint()
                raise Fail
        except Fail:        # llama.cpp throws: the text from there on (and the space before it) is content
            del out.calls[mark[1]:]
            out.content += held_text(src[max(begin, len(src[:mark[0]].rstrip(SPACE))):], partial)
        except Short:       # the reply ends here: what was read holds (llama.cpp's lenient parse)
            if cur.call is not None and cur.call.name:
                if not partial:
                    cur.call.arguments = closed_args(cur.call.arguments)
                out.calls.append(cur.call)
            elif not partial and len(out.calls) == mark[1]:
                out.content += src[mark[0]:]

    # --- JSON calls ------------------------------------------------------------------------

    def _json_sections(self, cur: Cursor, ctx: Context, out: Parsed, checkpoint: Callable[[], None]) -> None:
        if not self.section[0] and self.per_call[0]:
            opener, closer = self.per_call
            while cur.pos < len(cur.src):
                checkpoint()
                cur.need(opener)
                self._json_list(cur, ctx, out, closer)
                cur.space()
            return
        checkpoint()
        cur.need(self.section[0])
        self._json_list(cur, ctx, out, self.section[1])
        cur.space()

    def _json_list(self, cur: Cursor, ctx: Context, out: Parsed, closer: str) -> None:
        cur.space()
        if self.array:
            cur.need("[")
            cur.space()
        while True:
            out.calls.append(self._json_call(cur, ctx))
            cur.call = None
            save = cur.pos
            cur.space()
            if not ctx.parallel or not cur.opt(","):
                cur.pos = save
                break
            cur.space()
        if self.array:
            cur.space()
            cur.need("]")
        cur.space()
        cur.need(closer)

    def _json_call(self, cur: Cursor, ctx: Context) -> Call:
        cur.need("{")
        cur.space()
        if self.name_is_key:
            cur.need('"')
            return first_of(cur, tools_named(cur, ctx, ""), lambda n: self._keyed_call(cur, n))
        if self.openai_wrapper:
            save = cur.pos
            if not (cur.opt('"type"') and colon(cur) and cur.lit('"function"') and space_lit(cur, ",")):
                cur.pos = save
            cur.space()
        return self._flat_call(cur, ctx)

    def _keyed_call(self, cur: Cursor, name: str) -> Call:
        cur.need(name + '"')
        need_colon(cur)
        cur.call = Call(name, "", closed=False)
        args = self._args(cur)
        cur.space()
        cur.need("}")
        return Call(name, args)

    def _flat_call(self, cur: Cursor, ctx: Context) -> Call:
        name, args, ident = None, None, None
        for i, key in enumerate(self.order):
            if i:
                cur.space()
                cur.need(",")
                cur.space()
            if key in self.id_keys:
                ident = optional_id(cur, key) or ident
                continue
            cur.need(f'"{key}"')
            need_colon(cur)
            if key in self.NAME_KEYS:
                name = tools_named(cur, ctx, '"')[0]
                cur.pos += len(name) + 2
            else:
                cur.call = Call(name or "", "", closed=False, id=ident)
                args = self._args(cur)
        cur.space()
        cur.need("}")
        if name is None or args is None:
            raise Fail
        return Call(name, args, id=ident)

    def _args(self, cur: Cursor) -> str:
        """The arguments' raw JSON text; while it is open, the call's arguments so far."""
        start = cur.pos
        try:
            raw = cur.json()
        except Short:
            if cur.call is not None:
                cur.call.arguments = open_json(cur.src[start:])
            raise
        raw = raw if raw.startswith("{") else "{}"
        if cur.call is not None:
            cur.call.arguments = raw
        return raw

    # --- tag calls -------------------------------------------------------------------------

    def _tag_sections(self, cur: Cursor, ctx: Context, out: Parsed, checkpoint: Callable[[], None]) -> None:
        (s_open, s_close), (c_open, c_close) = self.section, self.per_call
        checkpoint()
        if not c_open:
            cur.need(s_open)
            out.calls.append(self._tag_call(cur, ctx))
            while ctx.parallel and cur.opt(", "):
                out.calls.append(self._tag_call(cur, ctx))
            cur.need(s_close)
            return
        if s_open:
            cur.need(s_open)
            cur.space()
        cur.need(c_open)
        while True:
            out.calls.append(self._tag_call(cur, ctx))
            cur.call = None
            cur.need(c_close)
            save = cur.pos
            cur.space()
            if not ctx.parallel or cur.pos >= len(cur.src) or not cur.lit(c_open):
                cur.pos = save
                break
            if not s_open:
                checkpoint()
        if s_open:
            cur.space()
            if s_close:
                cur.need(s_close)

    def _tag_call(self, cur: Cursor, ctx: Context) -> Call:
        cur.need(self.name_prefix)

        def read(name: str) -> Call:
            cur.pos += len(name)
            cur.need(self.name_suffix)
            ident = None
            if self.call_id:
                prefix, suffix = self.call_id
                if cur.lit(prefix):
                    ident, found = cur.until(suffix)
                    if not found:
                        raise Short
                cur.need(suffix)
            cur.space()
            cur.call = Call(name, "", closed=False, id=ident)
            args = self._args(cur)
            if self.close:
                cur.space()
                cur.need(self.close)
            return Call(name, args, id=ident)
        return first_of(cur, tools_named(cur, ctx), read)

    # --- the grammar -----------------------------------------------------------------------

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice, in this row's markers and keys (json_grammar.py)."""
        return row_grammar(self, ctx, choice)
