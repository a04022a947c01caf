"""MiniMax-M3's calls: every tag behind the namespace token ]<]minimax[>[ (NS below), a parameter
named by its own tag, objects and arrays written out as nested tags (llama.cpp's minimax_m3 parser):

    <mm:think>...</mm:think>            (or a bare </mm:think> where the turn does not think)
    NS<tool_call>
    NS<invoke name="get_time">NS<city>Tokyo NS</city>NS<when>NS<day>1NS</day>NS</when>NS</invoke>
    NS<invoke name="tag">NS<names>NS<item>a NS</item>NS<item>b NS</item>NS</names>NS</invoke>
    NS</tool_call>

A value is read by its schema: text where it may be a string (anything up to its closing tag), the
members of an object with properties, the <item>s of an array, a choice of anyOf's alternatives,
else JSON.
"""
from __future__ import annotations

import json
from typing import Any

from .base import Context, schema_types
from .xml_calls import XmlCalls, _Cursor, _Fail
from .xml_grammar import Lark, _permute, _q, head

NS = "]<]minimax[>["


class MiniMaxM3(XmlCalls):
    name = "minimax_m3"
    think = ("<mm:think>", "</mm:think>")
    prompt_think = "<mm:think>"
    think_ends_at_call, close_ws, bare_close = False, "", True
    section = (NS + "<tool_call>", NS + "</tool_call>")
    wrap = ("", "")
    call = (NS + '<invoke name="', '">', NS + "</invoke>")
    arg = (NS + "<", ">", "", "")
    flex, string_wins, tail = True, True, "content"
    detect_all = (NS, "<tool_call>", "<invoke name=")

    def _reasoning(self, text: str, ctx: Context, partial: bool, starts: tuple[str, ...]) -> tuple[str, str]:
        """A turn without reasoning starts with a bare </mm:think>, which is no text of the reply."""
        close = self.think[1]
        if ctx.extract_reasoning and not ctx.thinking_open:
            if text.startswith(close):
                return "", text[len(close):]
            if partial and text and close.startswith(text):
                return "", ""
        return super()._reasoning(text, ctx, partial, starts)

    def _arg(self, cur: _Cursor, ctx: Context, tool: str) -> tuple[str, Any]:
        return self._element(cur, (ctx.tools[tool] or {}).get("properties") or {})

    def _element(self, cur: _Cursor, props: dict) -> tuple[str, Any]:
        cur.lit(NS + "<")
        key = cur.until(">")
        if key not in props:
            raise _Fail
        return key, self._value(cur, props[key], f"{NS}</{key}>")

    def _value(self, cur: _Cursor, schema: Any, close: str) -> Any:
        """A value and its closing tag, read by its schema."""
        schema = schema if isinstance(schema, dict) else {}
        if "string" in schema_types(schema):
            return cur.until(close)
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if alternatives:
            at = cur.pos
            for alt in alternatives:
                try:
                    return self._value(cur, alt, close)
                except _Fail:
                    cur.pos = at
            raise _Fail
        if schema.get("type") == "object" and schema.get("properties"):
            return self._members(cur, schema, close)
        if schema.get("type") == "array":
            items = []
            while True:
                cur.ws()
                if not cur.at(NS + "<item>"):
                    break
                cur.lit(NS + "<item>")
                items.append(self._value(cur, schema.get("items"), NS + "</item>"))
            cur.lit(close)
            return items
        try:
            return json.loads(cur.until(close))
        except ValueError:
            raise _Fail from None

    def _members(self, cur: _Cursor, schema: dict, close: str) -> dict:
        out: dict[str, Any] = {}
        while True:
            cur.ws()
            if cur.at(close):
                cur.lit(close)
                break
            key, value = self._element(cur, schema["properties"])
            out[key] = value
        if set(schema.get("required") or ()) - set(out):
            raise _Fail
        return out

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The whole reply under a forced choice: reasoning (or the bare </mm:think>), any text,
        then the section of calls, each value written as its schema reads (see xml_grammar)."""
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        g = Lark()
        calls = [f'{_q(self.call[0] + n + self.call[1])} {_members_rule(g, ctx.tools[n] or {}, f"c{i}")} '
                 f'WS? {_q(self.call[2])}' for i, n in enumerate(allowed)]
        g.add("call", " | ".join(f"({c})" for c in calls))
        more = " (WS? call)*" if ctx.parallel else ""
        g.add("section_rest", f"WS? call{more} WS? {_q(self.section[1])}")
        return g.text(head(self, ctx, g, g.until(self.section[0])) + " section_rest WS?")


def _members_rule(g: Lark, schema: dict, name: str) -> str:
    """The members of an object, as rules named from `name`: the required ones in any order, then
    any of the optional ones."""
    props = schema.get("properties") or {}
    props = props if isinstance(props, dict) else {}
    need = [k for k in (schema.get("required") or ()) if k in props]
    rule = {k: g.add(f"{name}_{j}", f"WS? {_q(f'{NS}<{k}>')} {_value_rule(g, v, f'{NS}</{k}>', f'{name}_{j}')}")
            for j, (k, v) in enumerate(props.items())}
    args = _permute(g, f"{name}p", [rule[k] for k in need])
    optional = [rule[k] for k in props if k not in need]
    return f"{args} ({' | '.join(optional)})*" if optional else args


def _value_rule(g: Lark, schema: Any, close: str, name: str) -> str:
    schema = schema if isinstance(schema, dict) else {}
    if "string" in schema_types(schema):
        return g.until(close)
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        return "(" + " | ".join(_value_rule(g, alt, close, f"{name}a{k}") for k, alt in enumerate(alternatives)) + ")"
    if schema.get("type") == "object" and schema.get("properties"):
        return f"{_members_rule(g, schema, name + 'm')} WS? {_q(close)}"
    if schema.get("type") == "array":
        item = _value_rule(g, schema.get("items"), NS + "</item>", name + "i")
        return f"(WS? {_q(NS + '<item>')} {item})* WS? {_q(close)}"
    return f"%json {json.dumps(schema)} {_q(close)}"
