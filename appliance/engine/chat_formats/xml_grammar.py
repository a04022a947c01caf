r"""The grammar of an XML call row (xml_calls.XmlCalls.grammar): a Lark grammar for llguidance of the
WHOLE reply under a forced tool choice, as llama.cpp's grammars are (built from the same PEG parser
as its parse, see L/common/parsers/qwen3-coder.cpp and chat-auto-parser-generator.cpp):

    start: (think)? text-up-to-the-first-call's-opening-marker, then the calls
    qwen3 row:  "<think>"? u0 ...                   (the reasoning, optional; ended by </think>,
                                                      or, in the qwen3 rows, by the call itself)
                u1 WS? call WS? "</tool_call>" (WS? "<tool_call>" WS? call WS? "</tool_call>")*
    call: ("<function=" "add" ">\n" add_args "</function>\n") | ...
    add_args: the required arguments in any order (llama.cpp's permute), then any optional ones
    a0_0: "<parameter=" "a" ">\n" (%json {"type": "integer"} | u2) "\n</parameter>\n"

Whitespace (WS) goes where the row's parser skips it (flex rows: between any two tags; the qwen3
row writes its newlines as part of its markers, and takes any between calls). A string value is any
text up to its closing tag; any other value is JSON of its schema (llguidance's %json, whitespace
flexible), as the row's parser types it.

Markers are quoted literals in rules, so that special_tokens.py can make the special tokens of the
model's vocabulary of them. "Any text up to MARKER" (`until`) is written twice for that reason:
`u[lazy]: /(?s:.*)MARKER/` ends at the marker spelled out (a lazy lexeme ends at its first match),
and `ANY? "MARKER"` ends at the marker as a special token (one greedy lexeme of bytes, which a
special token, having no bytes, ends). llguidance refuses a special token as a `stop=` value
("special tokens cannot be used in terminals"), and special_tokens.py rewrites a quoted `stop="..."`
into a value that does not compile, so no rule here uses `stop=`.
"""
from __future__ import annotations

import json
from itertools import combinations
from typing import Any

from .base import Context, schema_types

XmlCalls = Any   # an XML call row (xml_calls.XmlCalls, which imports this module: no import back)

ALL = {"string", "number", "integer", "boolean", "null", "array", "object"}
MAX_PERMUTE = 6     # llama.cpp's COMMON_CHAT_MAX_PERMUTE: past it, required arguments in schema order


class Lark:
    """Rules being written, with the shared lexemes: ANY (any text), WS (whitespace)."""

    def __init__(self) -> None:
        self.rules: list[str] = ["ANY: /(?s:.+)/", "WS: /[ \\t\\r\\n]+/"]
        self._until: dict[tuple[str, str], str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def until(self, marker: str, not_first: str = "") -> str:
        """A rule: any text (not starting with `not_first`), then `marker` (spelled out or as a
        special token); see the module."""
        if (marker, not_first) not in self._until:
            name = f"u{len(self._until)}"
            but, text = (f" & ~/{_rx(not_first)}(?s:.*)/", f"{name.upper()}_ANY") if not_first else ("", "ANY")
            if not_first:
                self.rules.append(f"{text}: /(?s:.+)/{but}")
            self.rules.append(f"{name}: {name}_sp | {text}? {_q(marker)}")
            self.rules.append(f"{name}_sp[lazy]: /(?s:.*){_rx(marker)}/{but}")
            self._until[marker, not_first] = name
        return self._until[marker, not_first]

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules]) + "\n"


def head(row: XmlCalls, ctx: Context, g: Lark, rest: str) -> str:
    """The reply up to the calls: the reasoning (optional unless the prompt opened it and only its
    close ends it), then `rest`: any text up to and with the first call's opening marker."""
    if not row.think:
        return rest
    open_, close = row.think
    thought = g.until(close)
    if ctx.thinking_open:       # the reply starts inside the thought (a model may open it again)
        thought = f"{_q(open_)}? {thought}"
        if row.think_ends_at_call:
            return f"({thought} {rest} | {rest})"
        return f"{thought} {rest}"
    open_ = f"WS? {_q(open_)}"      # the parser skips whitespace before the thought
    if row.bare_close:
        return f"({open_} {thought} | {_q(close)})? {rest}"
    if row.think_ends_at_call:
        return f"({open_} ({thought} {rest} | {rest}) | {rest})"
    return f"({open_} {thought})? {rest}"


def grammar(row: XmlCalls, ctx: Context, choice: str) -> str | None:
    """The whole reply under a forced choice (`choice`: "required" or a tool's name): reasoning and
    text as the row reads them, then one call of the allowed tools, or with ctx.parallel several."""
    allowed = [n for n in ctx.tools if choice in ("required", n)]
    if not allowed:
        return None
    g, ws = Lark(), ("WS?" if row.flex else "")
    bodies = [_call_body(row, ctx, g, i, name, ws) for i, name in enumerate(allowed)]
    g.add("call", " | ".join(f"({_q(row.call[0] + name + row.call[1])} {b})" for name, b in zip(allowed, bodies)))
    if row.wrap[0]:
        g.add("rest", f"{ws} call {ws} {_q(row.wrap[1])}")     # a call after its wrap's opening marker
        g.add("wrapped", f"{_q(row.wrap[0])} rest")
    else:
        g.add("rest", " | ".join(f"({_q(name + row.call[1])} {b})" for name, b in zip(allowed, bodies)))
        g.add("wrapped", "call")
    more = "(WS? wrapped)*" if ctx.parallel else ""
    if row.section:
        g.add("section_rest", f"{ws} wrapped {more} {ws} {_q(row.section[1])}")
        return g.text(head(row, ctx, g, g.until(row.section[0])) + " section_rest WS?")
    opener = row.wrap[0] or row.call[0]
    first = f"{head(row, ctx, g, g.until(opener))} rest"
    if row.bare_first:      # Qwen3-Coder's first call may come without <tool_call>
        bare = " | ".join(f"({g.until(row.call[0] + n + row.call[1])} {b} {_q(row.wrap[1])})"
                          for n, b in zip(allowed, bodies))
        first = f"({first} | {head(row, ctx, g, '(' + bare + ')')})"
    return g.text(f"{first} {more} WS?")     # llama.cpp's space after the calls


def _call_body(row: XmlCalls, ctx: Context, g: Lark, i: int, name: str, ws: str) -> str:
    """A call's arguments and closing marker, after its name: the required ones in any order
    (each once), then any of the optional ones."""
    schema = ctx.tools[name] or {}
    props = schema.get("properties") or {}
    props = props if isinstance(props, dict) else {}
    need = [k for k in (schema.get("required") or ()) if k in props]
    rule = {k: g.add(f"a{i}_{j}", _arg(row, g, k, props[k], ws)) for j, k in enumerate(props)}
    args = _permute(g, f"p{i}", [rule[k] for k in need])
    optional = [rule[k] for k in props if k not in need]
    if optional:
        args += f" ({' | '.join(optional)})*"
    close = f"{ws} {_q(row.call[2])}" if row.call[2] else ""
    return f"{args} {close}".strip()


def _arg(row: XmlCalls, g: Lark, key: str, schema: Any, ws: str) -> str:
    key_open, key_close, value_open, value_close = row.arg
    types = schema_types(schema) or ALL
    if "string" in types:
        if row.cdata:       # a string may be a CDATA section, whose text may hold the closing tag
            value = f'({g.until(value_close, row.cdata[0])} | {_q(row.cdata[0])} {g.until(row.cdata[1])} {_q(value_close)})'
        else:
            value = g.until(value_close)
    else:
        # JSON with whitespace around it where the row's parser takes it (llguidance's %json takes none before)
        before, after = ("WS?" if value_open else "", "WS?") if row.flex else ("", "")
        value = f"{before} %json {json.dumps(schema if isinstance(schema, dict) else {})} {after} {_q(value_close)}"
    return f"{ws} {_q(key_open + key + key_close)} {ws} {_q(value_open)} {value}"


def _permute(g: Lark, prefix: str, rules: list[str]) -> str:
    """`rules` each once in any order (llama.cpp's permute, one rule per set of those left)."""
    if len(rules) <= 1 or len(rules) > MAX_PERMUTE:
        return " ".join(rules)
    names: dict[frozenset, str] = {}
    for size in range(1, len(rules) + 1):
        for left in combinations(range(len(rules)), size):
            key = frozenset(left)
            name = f"{prefix}_{'_'.join(map(str, left))}"
            alts = [f"{rules[k]} {names[key - {k}]}" if size > 1 else rules[k] for k in left]
            names[key] = g.add(name, " | ".join(alts))
    return names[frozenset(range(len(rules)))]


def _q(s: str) -> str:
    """A Lark string literal (empty: nothing)."""
    return json.dumps(s) if s else ""


def _rx(s: str) -> str:
    """`s` as a regex for a Lark /.../ literal."""
    return "".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in s)
