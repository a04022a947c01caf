"""The scanning steps llama.cpp's PEG chat parsers are made of (common/peg-parser.cpp), for the
JSON-argument families (jsoncalls.py and its neighbours): a Cursor over the reply that reads
literals, `until` a marker, whitespace and JSON values, and says Short where the text ends inside
what it reads (a partial reply: what was read before holds) or Fail where the text is not the
format (llama.cpp throws there).
"""
from __future__ import annotations

import json
import re
from typing import Callable

from .base import Call, Context, partial_suffix

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


def colon(cur: Cursor) -> bool:
    cur.space()
    if not cur.lit(":"):
        return False
    cur.space()
    return True


def need_colon(cur: Cursor) -> None:
    if not colon(cur):
        raise Fail


def space_lit(cur: Cursor, s: str) -> bool:
    cur.space()
    return cur.lit(s)


def optional_id(cur: Cursor, key: str) -> str | None:
    """An optional "key": "id" or "key": 12 (llama.cpp's id parsers)."""
    save = cur.pos
    if not cur.opt(f'"{key}"') or not colon(cur):
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
