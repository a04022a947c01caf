"""LFM2 / LFM2.5's Python-style calls against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.pythonic import Pythonic, PythonicThinking

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"]
CASES = params(TEMPLATES)
P, PT = Pythonic(), PythonicThinking()
TOOLS = {"get_time": {"type": "object", "properties": {"city": {"type": "string"}}},
         "set": {"type": "object", "properties": {"on": {"type": "boolean"}, "cfg": {"type": "object"},
                                                  "n": {"type": "number"}}},
         "Calendar.create": {"type": "object", "properties": {"title": {"type": "string"}, "who": {"type": "array"}}},
         "empty": {}}


def test_detected_and_reasoning_only_where_the_template_writes_think():
    got = {t: detect(templates.template(t)).name for t in TEMPLATES}
    assert got == {"LFM2-8B-A1B": "lfm2", "LFM2.5-8B-A1B": "lfm2-thinking", "LFM2.5-Instruct": "lfm2"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


@pytest.mark.parametrize("reply,content,calls", [
    # llama.cpp's test-chat.cpp cases (they hold without the recorded fixture too)
    ('Let me check.<|tool_call_start|>[get_time(city="Paris")]<|tool_call_end|>', "Let me check.",
     [("get_time", {"city": "Paris"})]),
    ("<|tool_call_start|>[set(on=True, cfg={'a': None, \"b\": [1, false]}, n=-2.5e3)]<|tool_call_end|>", "",
     [("set", {"on": True, "cfg": {"a": None, "b": [1, False]}, "n": -2500.0})]),
    ('<|tool_call_start|>[Calendar.create(title="it\'s \\"x\\"\\nend", who=["A", \'B\']), empty()]<|tool_call_end|>',
     "", [("Calendar.create", {"title": 'it\'s "x"\nend', "who": ["A", "B"]}), ("empty", {})]),
    ("Use [link](url).", "Use [link](url).", []),
    # llama.cpp fails on these; no text is lost
    ("<|tool_call_start|>[get_time(city=5)]<|tool_call_end|>", "<|tool_call_start|>[get_time(city=5)]<|tool_call_end|>",
     []),
    ('<|tool_call_start|>[empty()]<|tool_call_end|> after', " after", [("empty", {})]),
])
def test_reads_python_calls(reply, content, calls):
    got = P.parse(reply, Context(tools=TOOLS), partial=False)
    assert got.content == content and [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_think_block_is_reasoning_only_for_the_thinking_template():
    reply = "<think>Hmm <|tool_call_start|>[empty()]<|tool_call_end|></think>Hi"
    got = PT.parse(reply, Context(tools=TOOLS), partial=False)
    assert (got.reasoning, got.content, got.calls) == ("Hmm <|tool_call_start|>[empty()]<|tool_call_end|>", "Hi", [])
    assert P.parse("<think>a</think>b", Context(), partial=False).content == "<think>a</think>b"


def test_a_call_streams_argument_by_argument():
    reply = '<|tool_call_start|>[set(on=True, cfg={"k": "v"}, n=3)]<|tool_call_end|>'
    ctx = Context(tools=TOOLS)
    args = [c[0].arguments for n in range(len(reply)) if (c := P.parse(reply[:n], ctx, partial=True).calls)]
    assert args[0] == "{" and '{"on": true' in args and '{"on": true, "cfg": {"k": "v"}' in args
    assert all(b.startswith(a) for a, b in zip(args, args[1:])) and json.loads(args[-1])["n"] == 3


def test_grammar_reads_back_as_the_calls():
    ctx = Context(tools=TOOLS)
    g = P.grammar(ctx, "required")
    text = '<|tool_call_start|>[get_time(city="Paris"), set(on=True, cfg={"a": [1, None]})]<|tool_call_end|>'
    assert compiles(g) and accepts(g, text) and accepts(g, "<|tool_call_start|>[empty()]<|tool_call_end|>")
    assert not accepts(g, '<|tool_call_start|>[get_time(city=5)]<|tool_call_end|>')
    assert not accepts(P.grammar(Context(tools=TOOLS, parallel=False), "required"), text)
    assert not accepts(P.grammar(ctx, "empty"), text)
    got = P.parse(text, ctx, partial=False).calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [
        ("get_time", {"city": "Paris"}), ("set", {"on": True, "cfg": {"a": [1, None]}})]


MARKERS = ("<|tool_call_start|>", "<|tool_call_end|>", "<think>", "</think>")


@pytest.mark.parametrize("fmt,reply", [
    (P, "Let me <b>check</b>.\n<|tool_call_start|>[get_time(city='Paris'),\n set( on=true, cfg={ 'k' : [1, None] } )]"
        "<|tool_call_end|>"),
    (PT, '<think>The user asks for "time".</think>Checking.<|tool_call_start|>[ get_time(city="Paris") ]<|tool_call_end|>'),
    (PT, '<|tool_call_start|>[get_time(city="a\\"b")]<|tool_call_end|>'),
])
def test_grammar_takes_reasoning_text_and_spacing_spelled_and_as_special_tokens(fmt, reply):
    ctx = Context(tools=TOOLS)
    g = fmt.grammar(ctx, "required")
    assert accepts(g, reply) and accepts_special(g, reply, MARKERS)
    assert fmt.parse(reply, ctx, partial=False).calls


def test_grammar_takes_a_reasoning_block_that_holds_a_call():
    """The reasoning block comes first: text before the call list cannot open with <think>, so a
    call written inside the reasoning does not end the reply."""
    reply = "<think>Hmm <|tool_call_start|>[empty()]<|tool_call_end|></think><|tool_call_start|>[empty()]<|tool_call_end|>"
    ctx = Context(tools=TOOLS, parallel=False)
    g = PT.grammar(ctx, "required")
    assert accepts(g, reply)
    assert not accepts(g, reply[: reply.index("</think>")])
