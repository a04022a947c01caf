r"""The grammar of a forced tool choice for the JSON-argument families (llguidance Lark).

The contract every `grammar(ctx, choice)` of these families keeps: the grammar is the WHOLE reply
under a forced choice ("required": any tool of ctx.tools; else that one name), as llama.cpp's
grammars are (built from the same PEG parser as its parse: L/common/chat-peg-parser.cpp,
chat-auto-parser-generator.cpp, common/parsers/*.cpp), and what it takes the family's parse reads
back as those calls:

    1. the reasoning block first, optional, as the family reads it; where the prompt opened it
       (ctx.thinking_open) the reply starts inside it, and only its closing marker comes;
    2. text before the first call, optional, where the family (and llama.cpp) reads content there;
    3. one call (ctx.parallel: one or more) of the allowed tools in the family's own markers,
       whitespace (WS) wherever its parser skips it, the arguments a JSON value of the tool's
       schema (%json, which takes any whitespace between its tokens);
    4. markers as quoted literals in rules, never inside a /regex/: special_tokens.py makes the
       special tokens of the model's vocabulary of quoted literals, and no regex can match one.

"Any text up to MARKER" (`Lark.upto`) is written twice for that reason:

    u0: u0_l | TEXT? "MARKER"          u0_l[lazy]: /(?s:.*)MARKER/

The lazy lexeme ends at the first MARKER spelled out; the other branch takes any text and then
the marker as a literal of its own, which is what matches once the marker is a special token
(TEXT cannot take a special token, so it ends before it). llguidance takes no special token as a
`stop=` or `suffix=` value ("special tokens cannot be used in terminals"), so neither is used.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

WS_RULE = r"/[ \t\n\r\x0b\x0c]+/"             # C isspace: what llama.cpp's space() skips
ID_RULE = r'/"(?:[^"\\]|\\.)*"|-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?/'   # a call id: string or number


def q(s: str) -> str:
    """`s` as a quoted Lark literal ("" where empty: nothing)."""
    return json.dumps(s, ensure_ascii=False) if s else ""


def rx(s: str) -> str:
    """`s` as the body of a /regex/."""
    return "".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in s)


def args(schema: Any) -> str:
    """A call's arguments: a JSON object of the tool's parameters schema."""
    return value(schema if isinstance(schema, dict) and schema else {"type": "object"})


def value(schema: Any) -> str:
    """A JSON value of `schema` (any where it says nothing), its strings with any \\uXXXX escape
    (models trained on ensure_ascii JSON write them; llguidance takes only those of control
    characters unless told)."""
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema["x-guidance"] = {"json_allow_general_unicode_escapes": True, **(schema.get("x-guidance") or {})}
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


def allowed(ctx_tools: Iterable[str], choice: str) -> list[str]:
    return [n for n in ctx_tools if choice in ("required", n)]


class Lark:
    """Rules of a grammar being written, each added once."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._upto: dict[tuple, str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body)
        return name

    @property
    def ws(self) -> str:
        """Optional whitespace."""
        self.add("WS", WS_RULE)
        return "WS?"

    @property
    def id(self) -> str:
        return self.add("CALL_ID", ID_RULE)

    def upto(self, marker: str, avoid: str = "", inner: Iterable[str] = ()) -> str:
        """Any text, then `marker` (see the module's docstring). With `avoid`: text that does not
        begin with it (after whitespace): the reasoning's opening marker, which llguidance's lexer
        would otherwise lose to the longer text lexemes that also take it. With `inner`: those
        markers may come in the text (a reasoning block that holds a call's markers, which are
        special tokens TEXT cannot take)."""
        inner = tuple(m for m in inner if m and m != marker)
        key = (marker, avoid, inner)
        if key not in self._upto:
            name = f"u{len(self._upto)}"
            lazy = f"/(?s:.*){rx(marker)}/"
            text = self.add("TEXT", "/(?s:.+)/")
            if avoid:
                not_avoid = f" & ~/{WS_RULE[1:-2]}*{rx(avoid)}(?s:.*)/"
                text = self.add(f"TEXT_{name.upper()}", "/(?s:.+)/" + not_avoid)
                lazy = self.add(f"{name.upper()}_L", lazy + not_avoid)
            body = f"({' | '.join([text, *map(q, inner)])})*" if inner else f"{text}?"
            self.add(name, f"{name}_l | {body} {q(marker)}")
            self.add(f"{name}_l[lazy]", lazy)
            self._upto[key] = name
        return self._upto[key]

    def choice(self, name: str, bodies: list[str]) -> str:
        """A rule `name` that is one of `bodies` (one rule each: the tools' calls)."""
        for i, body in enumerate(bodies):
            self.add(f"{name}{i}", body)
        return self.add(name, " | ".join(f"{name}{i}" for i in range(len(bodies))))

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *(f"{k}: {v}" for k, v in self.rules.items())]) + "\n"


def some(one: str, parallel: bool, sep: str = "") -> str:
    """`one`, or with parallel calls one or more of it (`sep` between them)."""
    return f"{one} ({sep} {one})*" if parallel else one


def prefix_of(s: str) -> str:
    """An optional prefix of `s`, character by character (llama.cpp's optspace tail)."""
    out = ""
    for ch in reversed(s):
        out = f"({q(ch)} {out})?" if out else f"{q(ch)}?"
    return out


# --- the rows of llama.cpp's automatic parser (jsoncalls.AutoJson) --------------------------------

SPACE = " \t\n\r\v\f"
NAME_KEYS = ("name", "tool_name")


def row_grammar(row: Any, ctx: Any, choice: str) -> str | None:
    """An AutoJson row's forced-choice grammar: its reasoning, content up to the first call's
    marker, then the calls, as its parse (jsoncalls.AutoJson.parse) reads them."""
    names = allowed(ctx.tools, choice)
    if row.tools is None or not names:
        return None
    g = Lark()
    calls = (json_calls if row.tools == "json" else tag_calls)(row, g, ctx, names)
    return g.text(f"{reasoning(row, g, ctx)} {calls}")


def reasoning(row: Any, g: Lark, ctx: Any, lead: bool = True) -> str:
    """Leading whitespace (`lead`: the parse skips it) and the optional reasoning block; where the
    prompt opened it, the reply is inside it: its text, the closing marker and what may follow it."""
    opened = bool(ctx.thinking_open and row.reasoning)
    head = g.ws if lead and not opened else ""
    if not (row.reasoning and ctx.extract_reasoning):
        return head
    start, end = row.reasoning
    markers = (*row.section, *row.per_call, row.name_prefix, row.name_suffix, *(row.call_id or ()), row.close)
    block = f"{g.upto(end.strip(SPACE), inner=markers)} {prefix_of(end[len(end.rstrip(SPACE)):])}"
    return block if opened else f"{head} ({q(start.strip(SPACE))} {block})?"


def head(row: Any, g: Lark, ctx: Any) -> str:
    """Content, then the first call's marker: any text up to it, or (rows whose content is always
    wrapped) the optional wrapped content and the marker right after it. Where an optional
    reasoning block may come first, the content does not begin with its opening marker."""
    if row.wrap and row.tools == "json":
        return f"({q(row.wrap[0])} {g.upto(row.wrap[1])})? {q(row.tool_start)}"
    optional_reasoning = row.reasoning and ctx.extract_reasoning and not ctx.thinking_open
    return g.upto(row.tool_start, row.reasoning[0].strip(SPACE) if optional_reasoning else "")


def json_calls(row: Any, g: Lark, ctx: Any, names: list[str], first: str | None = None) -> str:
    """JSON objects: in a section (a [...] list where the row has one), each between per-call
    markers, or bare after the content (the first one's "{" is the marker the content ends at)."""
    w = g.ws
    call = g.choice("call", [json_call(row, g, n, ctx.tools[n]) for n in names])
    obj = f'"{{" {call}'
    first = head(row, g, ctx) if first is None else first
    if not (row.section[0] or row.per_call[0]):
        more = f'({w} "," {w} {obj})*' if ctx.parallel else ""
        return f"{first} {call} {more} {w}"
    body = some(obj, ctx.parallel, f'{w} "," {w}')
    body = f'"[" {w} {body} {w} "]"' if row.array else body
    if row.section[0]:
        return f"{first} {w} {body} {w} {q(row.section[1])} {w}"
    block = f"{w} {body} {w} {q(row.per_call[1])} {w}"
    return f"{first} {block} ({q(row.per_call[0])} {block})*" if ctx.parallel else f"{first} {block}"


def json_call(row: Any, g: Lark, name: str, schema: Any) -> str:
    """One call's object after its "{": the row's keys in its order (an id key as a string or a
    number), or {"name": {...}} where the name is the key."""
    w = g.ws
    if row.name_is_key:
        return f'{w} {q(json.dumps(name))} {w} ":" {w} {args(schema)} {w} "}}"'
    parts = [w]
    if row.openai_wrapper:
        parts.append(f'({q(chr(34) + "type" + chr(34))} {w} ":" {w} {q(chr(34) + "function" + chr(34))} {w} "," {w})?')
    for i, key in enumerate(row.order):
        if i:
            parts.append(f'{w} "," {w}')
        value = g.id if key in row.id_keys else q(json.dumps(name)) if key in NAME_KEYS else args(schema)
        parts.append(f'{q(json.dumps(key))} {w} ":" {w} {value}')
    return " ".join(parts) + f' {w} "}}"'


def tag_calls(row: Any, g: Lark, ctx: Any, names: list[str]) -> str:
    """Calls as tags: [SECTION] PER_CALL prefix NAME suffix [id] {...} [close] PER_CALL_END ... [SECTION_END]."""
    w = g.ws
    call = g.choice("call", [tag_call(row, g, n, ctx.tools[n]) for n in names])
    (s_open, s_close), (c_open, c_close) = row.section, row.per_call
    if not c_open:
        return f"{head(row, g, ctx)} {some(call, ctx.parallel, q(', '))} {q(s_close)}"
    block = f"{call} {q(c_close)}"
    more = f"({w} {q(c_open)} {block})*" if ctx.parallel else ""
    if s_open:
        return f"{head(row, g, ctx)} {w} {q(c_open)} {block} {more} {w} {q(s_close)}"
    return f"{head(row, g, ctx)} {block} {more}"


def tag_call(row: Any, g: Lark, name: str, schema: Any) -> str:
    parts = [q(row.name_prefix + name + row.name_suffix)]
    if row.call_id:
        prefix, suffix = row.call_id
        parts.append(f"({q(prefix)} {g.upto(suffix)} | {q(suffix)})")
    parts.append(f"{g.ws} {args(schema)}")
    if row.close:
        parts.append(f"{g.ws} {q(row.close)}")
    return " ".join(parts)
