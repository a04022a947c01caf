"""`tool_choice: auto` holds a reply to its format's grammar from where a call begins, as
llama.cpp's lazy grammars do: for every reply of the reference (chat_templates/llama_chat.json)
read with tools offered, fed byte by byte (byte_grammar.py's vocabulary), no byte is masked
before the call's marker (reasoning and content run free, a marker inside the reasoning too),
every byte of the model's own call is allowed after it, and a reply without a call is never
held to anything. Where a call is read, what the grammar took reads back as those calls.
"""
from __future__ import annotations

import json

import pytest

from appliance.engine import chat_formats
from appliance.engine.chat_layer import ChatLayer
from appliance.engine.output.constraints import Constraints, LazyMatcher
from appliance.engine.types import Constraint

from ..chat_templates import cases
from .byte_grammar import EOS, tokenizer
from .reference import context

REFERENCE = cases.chat_reference()


def auto_replies() -> list[tuple[str, dict]]:
    out = []
    for name, t in sorted(REFERENCE.items()):
        for c in t["cases"]:
            msg, r = c.get("message"), c["request"]
            if c.get("partial") or not msg or "error" in msg or not r.get("tools"):
                continue
            if r["messages"][-1]["role"] == "assistant" or r.get("tool_choice", "auto") != "auto":
                continue   # a continuation (its prefill parsed with it), or a forced choice
            if r.get("json_schema") or r.get("reasoning_format") == "none":
                continue
            out.append((name, c))
    return out


CASES = auto_replies()


def lazy(fmt: chat_formats.Format, ctx: chat_formats.Context) -> LazyMatcher | None:
    grammar = fmt.grammar(ctx, "required")
    if grammar is None:
        return None
    owner = Constraints(tokenizer, EOS + 1, tokenize=lambda s: list(s.encode()), piece=lambda t: bytes([t]))
    return owner.lazy(Constraint("lark", grammar), lambda text: fmt.call_begins(text, ctx), fmt.triggers(ctx))


def run(m: LazyMatcher, reply: str) -> tuple[int | None, bytes, bool]:
    """Feed `reply`: where the grammar began (a byte offset, None if never), the bytes it took
    until it was complete or refused one, and whether it refused one."""
    data, began = reply.encode(), None
    for i, b in enumerate(data):
        if m.done():
            return began, data[:i], False
        mask = m.allowed()
        if mask is not None:
            began = i if began is None else began
            if not mask[b]:
                return began, data[:i], True
        m.accept(b)
    return began, data, False


@pytest.mark.parametrize("template,case", CASES, ids=[f"{t}-{c['name']}" for t, c in CASES])
def test_auto_holds_a_call_to_its_grammar_from_its_marker_and_nothing_else(template, case):
    """What the grammar takes reads as llama.cpp's calls (text after them may be refused, as
    llama.cpp's grammars end the reply there); a reply llama.cpp reads no call from is either
    never held or is a call the grammar refuses (of a tool the request did not offer)."""
    fmt = chat_formats.detect(cases.template(template))
    ctx = context(fmt, case["request"], case.get("generation_prompt") or REFERENCE[template]["apply"]["tools"]
                  ["generation_prompt"])
    want = [(c["name"], json.loads(c["arguments"] or "{}")) for c in case["message"]["tool_calls"] or []]
    m = lazy(fmt, ctx)
    if m is None:   # a template that writes no calls: served in the generic format, which has one
        served = ChatLayer(cases.template(template)).tool_format
        assert served is not fmt and served.grammar(ctx, "required") is not None, f"{fmt.name}: no grammar"
        return
    began, took, refused = run(m, case["reply"])
    if not want:
        assert began is None or refused, "a reply without a call was held to the grammar"
        if began is not None:
            assert not any(c.closed for c in fmt.parse(case["reply"], ctx, partial=False).calls)
        return
    assert began is not None, "the call's grammar never began"
    parsed = fmt.parse(took.decode(), ctx, partial=False)
    assert [(c.name, json.loads(c.arguments or "{}")) for c in parsed.calls] == want, \
        f"refused at {took[-30:]!r}" if refused else "took all"


def test_a_call_of_a_tool_not_offered_is_refused_once_it_begins():
    fmt = chat_formats.by_name("hermes")
    ctx = chat_formats.Context(tools={"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}})
    m = lazy(fmt, ctx)
    text = 'Let me look. <tool_call>\n{"name": "'
    for b in text.encode():
        m.accept(b)
    mask = m.allowed()
    assert mask is not None and mask[ord("g")] and not mask[ord("l")]
    # once complete, the reply may only end (or call again)
    for b in 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'.encode():
        m.accept(b)
    mask = m.allowed()
    assert mask[EOS] and not mask[ord("D")]


def test_a_marker_in_the_reasoning_or_in_content_that_is_no_call_holds_nothing():
    fmt = chat_formats.by_name("hermes")
    ctx = chat_formats.Context(tools={"get_weather": {"type": "object"}})
    m = lazy(fmt, ctx)
    for b in "<think>I could write <tool_call> here.</think>Plain words.".encode():
        assert m.allowed() is None
        m.accept(b)
    assert m.allowed() is None and not m.given_up


def test_a_format_whose_grammar_starts_at_the_call_takes_it_from_the_marker():
    """The generic format (templates without tools) is forced to call at once; under auto, text
    may come first and the grammar takes the call from its marker."""
    fmt = chat_formats.Generic(chat_formats.by_name("hermes"))
    ctx = chat_formats.Context(tools={"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}})
    m = lazy(fmt, ctx)
    began, took, refused = run(m, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert began is not None and m.active is not None and not refused
    assert [c.name for c in fmt.parse(took.decode(), ctx, partial=False).calls] == ["get_weather"]
