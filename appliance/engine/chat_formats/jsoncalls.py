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
import re
from typing import Any, Callable, ClassVar

from .base import Call, Context, Format, Parsed, open_json, partial_suffix

SPACE = " \t\n\r\v\f"          # C isspace, what llama.cpp's space() skips


class Short(Exception):
    """The text ends inside this piece: what was read before it holds."""


class Fail(Exception):
    """The text does not read as the format from here on (llama.cpp throws)."""


class Cursor:
    """A position in the text and the PEG steps llama.cpp's parsers are made of."""

    def __init__(self, src: str) -> None:
        self.src, self.pos = src, 0
        self.call: Call | None = None       # the call being read, once its arguments began
        self.short_name = False              # the text ends inside a longer tool name

    def space(self) -> None:
        n = len(self.src)
        while self.pos < n and self.src[self.pos] in SPACE:
            self.pos += 1

    def lit(self, s: str) -> bool:
        """Read `s` if it is next; Short where the text ends inside it."""
        if self.src.startswith(s, self.pos):
            self.pos += len(s)
            return True
        rest = self.src[self.pos:]
        if len(rest) < len(s) and s.startswith(rest):
            raise Short
        return False

    def opt(self, s: str) -> bool:
        """An optional `s`: absent at the end of the text (llama.cpp's repetitions stop there)."""
        return self.pos < len(self.src) and self.lit(s)

    def need(self, s: str) -> None:
        if not self.lit(s):
            raise Fail

    def optspace(self, tag: str) -> bool:
        """llama.cpp's optspace(tag): the tag with its own leading and trailing whitespace optional."""
        core = tag.strip(SPACE)
        head, tail = tag[: len(tag) - len(tag.lstrip(SPACE))], tag[len(tag.rstrip(SPACE)):]
        save = self.pos
        for ch in head:
            self.lit(ch)
        if not self.lit(core):
            self.pos = save
            return False
        for ch in tail:
            if self.pos >= len(self.src) or not self.lit(ch):
                break
        return True

    def until(self, *delims: str) -> tuple[str, bool]:
        """The text up to the first of `delims` (and True), else up to the end (and False)."""
        found = [at for at in (self.src.find(d, self.pos) for d in delims) if at >= 0]
        start = self.pos
        self.pos = min(found) if found else len(self.src)
        return self.src[start:self.pos], bool(found)

    def json(self) -> str:
        """The raw text of the JSON value that is next; Short where it is not closed yet."""
        end = json_end(self.src, self.pos)
        if end < 0:
            raise Short
        try:
            json.loads(self.src[self.pos:end])
        except ValueError:
            raise Fail from None
        raw, self.pos = self.src[self.pos:end], end
        return raw


_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.S)
_STRUCT = re.compile(r'["{}\[\]]')
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SCALAR = re.compile(_NUMBER.pattern + r"|true|false|null")


def json_end(src: str, pos: int) -> int:
    """Where the JSON value at `pos` ends, or -1 where the text ends first."""
    if pos >= len(src):
        return -1
    if src[pos] == '"':
        m = _STRING_BODY.match(src, pos + 1)
        return m.end() + 1 if m.end() < len(src) else -1
    if src[pos] not in "{[":
        m = _SCALAR.match(src, pos)
        return pos + 1 if m is None else (-1 if m.end() >= len(src) else m.end())
    depth, i = 0, pos
    while True:
        m = _STRUCT.search(src, i)
        if m is None:
            return -1
        c, i = m.group(0), m.end()
        if c == '"':
            body = _STRING_BODY.match(src, i)
            if body.end() >= len(src):
                return -1
            i = body.end() + 1
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i


def tools_named(cur: Cursor, ctx: Context, quote: str = "") -> list[str]:
    """The request's tools whose name (between `quote`s) is next, in order; Short where the text
    ends inside a name (first_of then says Short where the names read so far fail)."""
    rest = cur.src[cur.pos:cur.pos + 400]
    out, cur.short_name = [], False
    for name in ctx.tools:
        lit = f"{quote}{name}{quote}"
        if rest.startswith(lit):
            out.append(name)
        elif len(rest) < len(lit) and lit.startswith(rest):
            cur.short_name = True
    if not out:
        raise Short if cur.short_name else Fail
    return out


def first_of(cur: Cursor, names: list[str], read: Callable[[str], Call]) -> Call:
    """llama.cpp's choice over the tools: the first whose whole parser reads the text (Short
    where none does yet and a longer name may still come)."""
    save, short = cur.pos, cur.short_name
    for name in names:
        cur.pos = save
        try:
            return read(name)
        except Fail:
            pass
    raise Short if short else Fail


def held_text(text: str, partial: bool, markers: tuple[str, ...] = ()) -> str:
    """Text read up to one of `markers` (or the end), as far as it is final: less a tail that
    may still become a marker (llama.cpp's `until` stops before it, whole replies too), and
    while partial less trailing whitespace."""
    text = text[: len(text) - partial_suffix(text, markers)] if markers else text
    return text.rstrip(SPACE) if partial else text


def closed_args(args: str) -> str:
    """An open call's arguments at the end of a reply: closed as far as they came."""
    text = args.rstrip(SPACE + ",")
    if not text:
        return "{}"
    depth = sum(text.count(c) for c in "{[") - sum(text.count(c) for c in "}]")
    return text + "}" * max(depth, 0)


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
            if not (cur.opt('"type"') and _colon(cur) and cur.lit('"function"') and _space_lit(cur, ",")):
                cur.pos = save
            cur.space()
        return self._flat_call(cur, ctx)

    def _keyed_call(self, cur: Cursor, name: str) -> Call:
        cur.need(name + '"')
        _need_colon(cur)
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
                ident = _optional_id(cur, key) or ident
                continue
            cur.need(f'"{key}"')
            _need_colon(cur)
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
        """Calls of the allowed tools in this row's own markers and keys (llguidance Lark)."""
        if self.tools is None:
            return None
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules, names = [], []
        for i, n in enumerate(allowed):
            schema = ctx.tools[n] or {"type": "object"}
            names.append(f"c{i}")
            rules.append(f"c{i}: {self._call_text(n, schema)}")
        calls = " | ".join(names)
        if self.tools == "json" and not (self.section[0] or self.per_call[0]) and not self.array:
            start = "call"
        elif self.tools == "json" and (self.section[0] or self.array):
            sep = ' ", " ' if self.array else ' ", " '
            body = f"call ({sep} call)*" if ctx.parallel else "call"
            body = f'"[" {body} "]"' if self.array else body
            start = f"{_q(self.section[0])} {body} {_q(self.section[1])}"
        elif self.tools == "json":
            one = f"{_q(self.per_call[0])} call {_q(self.per_call[1])}"
            start = f"({one})+" if ctx.parallel else one
        else:
            one = f"{_q(self.per_call[0])} call {_q(self.per_call[1])}"
            body = (f"{one} ({one})*" if ctx.parallel else one) if self.per_call[0] else \
                ('call (", " call)*' if ctx.parallel else "call")
            start = f"{_q(self.section[0])} {body} {_q(self.section[1])}"
        return f"start: {start}\ncall: {calls}\n" + "\n".join(rules) + "\n"

    def _call_text(self, name: str, schema: Any) -> str:
        args = f"%json {json.dumps(schema)}"
        if self.tools == "tag":
            return f"{_q(self.name_prefix + name + self.name_suffix + (self.call_id[1] if self.call_id else ''))} " \
                   f"{args} {_q(self.close)}"
        if self.name_is_key:
            return f'{_q("{" + json.dumps(name) + ": ")} {args} "}}"'
        head, key_n = "{", next(k for k in self.order if k in self.NAME_KEYS)
        key_a = next(k for k in self.order if k not in self.NAME_KEYS and k not in self.id_keys)
        parts = []
        for k in self.order:
            if k == key_n:
                parts.append(_q(f"{json.dumps(k)}: {json.dumps(name)}"))
            elif k == key_a:
                parts.append(f"{_q(json.dumps(k) + ': ')} {args}")
            else:
                parts.append(_q(f'{json.dumps(k)}: "0"'))
        return f'{_q(head)} ' + ' ", " '.join(parts) + ' "}"'


def _q(s: str) -> str:
    return json.dumps(s) if s else ""


def _colon(cur: Cursor) -> bool:
    cur.space()
    if not cur.lit(":"):
        return False
    cur.space()
    return True


def _need_colon(cur: Cursor) -> None:
    if not _colon(cur):
        raise Fail


def _space_lit(cur: Cursor, s: str) -> bool:
    cur.space()
    return cur.lit(s)


def _optional_id(cur: Cursor, key: str) -> str | None:
    """An optional "key": "id" or "key": 12 (llama.cpp's id parsers)."""
    save = cur.pos
    if not cur.opt(f'"{key}"') or not _colon(cur):
        cur.pos = save
        return None
    if cur.lit('"'):
        m = _STRING_BODY.match(cur.src, cur.pos)
        if m.end() >= len(cur.src):
            raise Short
        cur.pos = m.end() + 1
        return m.group(0)
    m = _NUMBER.match(cur.src, cur.pos)
    if m is None:
        cur.pos = save
        return None
    if m.end() >= len(cur.src):
        raise Short
    cur.pos = m.end()
    return m.group(0)
