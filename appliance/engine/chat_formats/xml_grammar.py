r"""The grammar of an XML call row (xml_calls.XmlCalls.grammar): a Lark grammar for llguidance whose
every sentence is one call (or, with parallel calls, several) of the allowed tools in the row's own
markers, laid out as the row's parser reads it back:

    start: "<tool_call>\n" call "</tool_call>" ("\n" "<tool_call>\n" call "</tool_call>")*
    call: ("<function=add>\n" a0_0 a0_1 "</function>\n") | ...
    a0_0: "<parameter=a>\n" %json {"type": "integer"} "\n</parameter>\n"
    str_value[lazy]: /(?s:.*)\n<\/parameter>\n/        (a string: any text up to its closing tag)
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .base import Context, schema_types

if TYPE_CHECKING:
    from .xml_calls import XmlCalls

ALL = {"string", "number", "integer", "boolean", "null", "array", "object"}


def grammar(row: XmlCalls, ctx: Context, choice: str) -> str | None:
    """Calls in the row's canonical layout (a newline between tags where the row allows
    whitespace): required arguments first, then the optional ones, each in schema order; a
    string value is any text up to its closing tag, any other a JSON value of its schema."""
    allowed = [n for n in ctx.tools if choice in ("required", n)]
    if not allowed:
        return None
    sep = '"\\n"' if row.flex else ""
    value_close = row.arg[3]
    rules = [f"str_value[lazy]: /(?s:.*){_rx(value_close)}/"]
    calls = []
    for i, name in enumerate(allowed):
        schema = ctx.tools[name] or {}
        props = schema.get("properties") or {}
        need = set(schema.get("required") or ())
        order = [k for k in props if k in need] + [k for k in props if k not in need]
        args = []
        for j, key in enumerate(order):
            rules.append(f"a{i}_{j}: {sep} {_q(row.arg[0] + key + row.arg[1])} {sep} "
                         f"{_q(row.arg[2]) if row.arg[2] else ''} {_value_rule(props[key], value_close)}")
            args.append(f"a{i}_{j}" + ("" if key in need else "?"))
        name_close = row.call[1] or ""
        close = (f"{sep} {_q(row.call[2])}" if row.call[2] else "")
        calls.append(f"{_q(row.call[0] + name + name_close)} {' '.join(args)} {close}")
    rules.append("call: " + " | ".join(f"({c})" for c in calls))
    wrapped = f"{_q(row.wrap[0])} {sep} call {sep} {_q(row.wrap[1])}" if row.wrap[0] else "call"
    if row.section:
        more = f'({sep} {wrapped})*' if ctx.parallel else ""
        block = f"{_q(row.section[0])} {sep} {wrapped} {more} {sep} {_q(row.section[1])}"
        return "\n".join([f"start: {block}", *rules]) + "\n"
    start = f'{wrapped} ("\\n" {wrapped})*' if ctx.parallel else wrapped
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _value_rule(schema: Any, close: str) -> str:
    types = schema_types(schema) or ALL
    if "string" in types:
        return "str_value"
    return f"%json {json.dumps(schema if isinstance(schema, dict) else {})} {_q(close)}"


def _q(s: str) -> str:
    """A Lark string literal (empty: nothing)."""
    return json.dumps(s) if s else ""


def _rx(s: str) -> str:
    """`s` as a regex for a Lark /.../ literal."""
    return "".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in s)

