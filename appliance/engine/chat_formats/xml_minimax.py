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
from .xml_grammar import _q, _rx

NS = "]<]minimax[>["


class MiniMaxM3(XmlCalls):
    name = "minimax_m3"
    think = ("<mm:think>", "</mm:think>")
    prompt_think = "<mm:think>"
    think_ends_at_call, close_ws = False, ""
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
        allowed = [n for n in ctx.tools if choice in ("required", n)]
        if not allowed:
            return None
        rules: list[str] = []
        calls = [f'{_q(self.call[0] + n + self.call[1])} {_members_rule(ctx.tools[n] or {}, f"c{i}", rules)} '
                 f'{_q(self.call[2])}' for i, n in enumerate(allowed)]
        rules.append("call: " + " | ".join(f"({c})" for c in calls))
        more = ' ("\\n" call)*' if ctx.parallel else ""
        return "\n".join([f'start: {_q(self.section[0] + chr(10))} call{more} {_q(chr(10) + self.section[1])}',
                          *rules]) + "\n"


def _members_rule(schema: dict, name: str, rules: list[str]) -> str:
    """The members of an object (required first, then the optional ones), as rules named from `name`."""
    props = schema.get("properties") or {}
    need = set(schema.get("required") or ())
    parts = []
    for j, key in enumerate([k for k in props if k in need] + [k for k in props if k not in need]):
        rule = f"{name}_{j}"
        rules.append(f"{rule}: {_q(f'{NS}<{key}>')} {_value_rule(props[key], f'{NS}</{key}>', rule, rules)}")
        parts.append(rule + ("" if key in need else "?"))
    return " ".join(parts)


def _value_rule(schema: Any, close: str, name: str, rules: list[str]) -> str:
    schema = schema if isinstance(schema, dict) else {}
    if "string" in schema_types(schema):
        rules.append(f"{name}_s[lazy]: /(?s:.*){_rx(close)}/")
        return f"{name}_s"
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        return "(" + " | ".join(_value_rule(alt, close, f"{name}a{k}", rules) for k, alt in enumerate(alternatives)) + ")"
    if schema.get("type") == "object" and schema.get("properties"):
        return f"{_members_rule(schema, name + 'm', rules)} {_q(close)}"
    if schema.get("type") == "array":
        item = _value_rule(schema.get("items"), NS + "</item>", name + "i", rules)
        return f"({_q(NS + '<item>')} {item})* {_q(close)}"
    return f"%json {json.dumps(schema)} {_q(close)}"
