"""A forced tool choice's grammar lets a model write the calls it writes: for every reply of
the reference (chat_templates/llama_chat.json) from which llama.cpp read tool calls, the
format's grammar for tool_choice "required" (and for the first call's name) takes the reply as
the model wrote it, reasoning and any text before the calls included (llama.cpp's grammars take
them too), up to where the grammar is complete; and what it took reads back as those calls.

Fed byte by byte over a vocabulary of the 256 bytes (byte_grammar.py): the markers are text
here; the special tokens a real vocabulary makes of them are tests/web/test_model_formats_e2e.py's.
"""
from __future__ import annotations

import json

import llguidance
import pytest

from appliance.engine import chat_formats

from ..chat_templates import cases
from .byte_grammar import tokenizer
from .reference import context

REFERENCE = cases.chat_reference()


def replies_with_calls() -> list[tuple[str, dict]]:
    out = []
    for name, t in sorted(REFERENCE.items()):
        for c in t["cases"]:
            msg, r = c.get("message"), c["request"]
            if c.get("partial") or not msg or "error" in msg or not msg.get("tool_calls"):
                continue
            if r["messages"][-1]["role"] == "assistant" or r.get("tool_choice", "auto") == "none":
                continue   # a continuation (its prefill parsed with it), or calls not asked for
            if r.get("json_schema") or r.get("reasoning_format") == "none":
                continue   # the answer's own schema; reasoning left in the content
            out.append((name, c))
    return out


CASES = replies_with_calls()


def calls(message_calls) -> list[tuple[str, object]]:
    return [(c["name"], json.loads(c["arguments"] or "{}")) for c in message_calls]


def taken(grammar: str, text: str) -> str | None:
    """The part of `text` the grammar takes until it is complete (all of it where it ends
    with the text), or None where it refuses a byte first or is not complete by the end."""
    m = llguidance.LLMatcher(tokenizer(), llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    data = text.encode()
    for i, b in enumerate(data):
        if m.is_stopped():                 # complete: nothing may follow
            return data[:i].decode(errors="replace")
        could_end = m.is_accepting()
        if not m.consume_token(b):         # refused: fine where the grammar could end before it
            return data[:i].decode(errors="replace") if could_end else None
    return text if m.is_accepting() else None


@pytest.mark.parametrize("template,case", CASES, ids=[f"{t}-{c['name']}" for t, c in CASES])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_forced_grammar_takes_the_calls_the_model_writes(template, case, choice):
    fmt = chat_formats.detect(cases.template(template))
    ctx = context(fmt, case["request"], case.get("generation_prompt") or REFERENCE[template]["apply"]["tools"]
                  ["generation_prompt"])
    want = calls(case["message"]["tool_calls"])
    if choice == "named" and len({n for n, _ in want}) > 1:
        pytest.skip("calls of several tools: a named choice allows one")
    grammar = fmt.grammar(ctx, "required" if choice == "required" else want[0][0])
    assert grammar is not None, f"{fmt.name} has no grammar"
    got = taken(grammar, case["reply"])
    assert got is not None, f"{fmt.name}'s grammar refuses {case['reply']!r}:\n{grammar}"
    parsed = fmt.parse(got, ctx, partial=False)
    assert [(c.name, json.loads(c.arguments or "{}")) for c in parsed.calls] == want
