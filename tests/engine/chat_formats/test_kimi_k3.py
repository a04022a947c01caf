"""Kimi K3's tagged sections against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.kimi_k3 import KimiK3

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["Kimi-K3"]
CASES = params(TEMPLATES)
K = KimiK3()
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "opts": {"type": "object"}}},
         "ping": {}}
OPEN = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'   # its generation prompt


def test_detected_and_the_prompt_opens_the_think_section():
    assert detect(templates.template("Kimi-K3")).name == "kimi-k3"
    assert K.prompt_opens_thinking(OPEN)


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


CALL = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>12<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument key="opts" type="object"<|sep|>{"a": [1]}<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


@pytest.mark.parametrize("reply,content,reasoning,calls", [
    ("Hmm<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>",
     "Hi", "Hmm", []),
    ("Out of budget", "", "Out of budget", []),
    ("Hmm<|open|>response<|sep|>Hi", "Hi", "Hmm", []),                     # no think closer
    ("<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>" + CALL, "On it.", "",
     [("get_weather", {"city": "12", "days": 3, "opts": {"a": [1]}})]),  # typed by the schema
    # llama.cpp fails on these; no text is lost
    ("<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"nope\" index=\"1\"<|sep|><|close|>call<|sep|>",
     '<|open|>tools<|sep|><|open|>call tool="nope" index="1"<|sep|><|close|>call<|sep|>', "", []),
    ("<|close|>think<|sep|>Hi<|close|>response<|sep|>more", "Himore", "", []),
])
def test_reads_the_sections(reply, content, reasoning, calls):
    got = K.parse(reply, Context(tools=TOOLS, thinking_open=True), partial=False)
    assert (got.content, got.reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_a_call_streams_argument_by_argument():
    ctx = Context(tools=TOOLS, thinking_open=True)
    reply = "<|close|>think<|sep|>" + CALL
    args = [c[0].arguments for n in range(len(reply) + 1) if (c := K.parse(reply[:n], ctx, partial=True).calls)]
    assert args[0] == "{" and '{"city":"12"' in args and '{"city":"12","days":3' in args
    assert all(b.startswith(a) for a, b in zip(args, args[1:])) and json.loads(args[-1])["opts"] == {"a": [1]}


def test_grammar_reads_back_as_the_call():
    ctx = Context(tools=TOOLS, thinking_open=True)
    g = K.grammar(ctx, "required")
    text = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>Paris <x><|close|>argument<|sep|>'
            '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')
    assert compiles(g) and accepts(g, text) and not accepts(K.grammar(ctx, "ping"), text)
    got = K.parse(text, ctx, partial=False)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris <x>", "days": 3})]


MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
TOOLS_CALL = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|> 3 <|close|>argument<|sep|>'
        '<|open|>argument key="opts" type="object"<|sep|>{"a": [1, "<b>"]}<|close|>argument<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris, "FR"<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|open|>call tool="ping" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')


@pytest.mark.parametrize("ctx,reply", [
    (Context(tools=TOOLS, thinking_open=True), "Let me <think> it over.<|close|>think<|sep|>"
     "<|open|>response<|sep|>On it.<|close|>response<|sep|>" + TOOLS_CALL + "<|close|>message<|sep|><|end_of_msg|>"),
    (Context(tools=TOOLS, thinking_open=True), "Skipped the closer.<|open|>response<|sep|>On it.<|close|>response<|sep|>" + TOOLS_CALL),
    (Context(tools=TOOLS, thinking_open=True), "<|close|>think<|sep|>" + TOOLS_CALL + "<|close|>message<|sep|>"),
    (Context(tools=TOOLS), OPEN + "Hmm.<|close|>think<|sep|>" + TOOLS_CALL),
])
def test_grammar_takes_the_sections_spelled_and_as_special_tokens(ctx, reply):
    g = K.grammar(ctx, "required")
    assert accepts(g, reply) and accepts_special(g, reply, MARKERS)
    got = K.parse(reply, ctx, partial=False).calls
    assert [c.name for c in got] == ["get_weather", "ping"]
    assert json.loads(got[0].arguments) == {"days": 3, "opts": {"a": [1, "<b>"]}, "city": 'Paris, "FR"'}


def test_grammar_types_the_arguments_by_the_schema():
    g = K.grammar(Context(tools=TOOLS, thinking_open=True), "get_weather")
    bad = TOOLS_CALL.replace("> 3 <", ">three<")
    assert not accepts(g, "<|close|>think<|sep|>" + bad)
