"""Muse Glimmer's messages and ATEM calls against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.muse import Muse

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["muse-glimmer"]
CASES = params(TEMPLATES)
M = Muse()
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "ping": {}}
CALL = (' to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
        '<atem:parameter name="city">12</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n'
        '</atem:invoke>\n</atem:function_calls>')


def test_detected_by_its_markup():
    assert detect(templates.template("muse-glimmer")).name == "muse-glimmer"


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


@pytest.mark.parametrize("reply,content,reasoning,calls", [
    (" to=self<|message|>Hmm<|eom|><|start|>assistant to=user<|message|>Hi<|eot|>", "Hi", "Hmm", []),
    (" to=user<|message|>Checking.<|eom|><|start|>assistant" + CALL, "Checking.", "",
     [("get_weather", {"city": "12", "days": 3})]),                       # typed by the schema
    (CALL + "<|eom|><|start|>assistant" + CALL.replace("12", "34"), "", "",
     [("get_weather", {"city": "12", "days": 3}), ("get_weather", {"city": "34", "days": 3})]),
    (" to=python<|message|>print(1)", " to=python<|message|>print(1)", "", []),   # llama.cpp fails: kept
])
def test_reads_messages_and_calls(reply, content, reasoning, calls):
    got = M.parse(reply, Context(tools=TOOLS), partial=False)
    assert (got.content, got.reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_a_call_streams_argument_by_argument():
    ctx = Context(tools=TOOLS)
    args = [c[0].arguments for n in range(len(CALL) + 1) if (c := M.parse(CALL[:n], ctx, partial=True).calls)]
    assert args[0] == "{" and '{"city":"12"' in args and all(b.startswith(a) for a, b in zip(args, args[1:]))
    assert args[-1] == '{"city":"12","days":3}'


def test_grammar_reads_back_as_the_calls():
    ctx = Context(tools=TOOLS)
    g = M.grammar(ctx, "required")
    text = CALL + "<|eom|><|start|>assistant" + (' to=ping<|message|><atem:function_calls>\n<atem:invoke name="ping">\n'
                                                 '</atem:invoke>\n</atem:function_calls>')
    assert compiles(g) and accepts(g, CALL) and accepts(g, text) and not accepts(M.grammar(ctx, "ping"), CALL)
    assert [(c.name, json.loads(c.arguments)) for c in M.parse(text, ctx, partial=False).calls] == [
        ("get_weather", {"city": "12", "days": 3}), ("ping", {})]


MARKERS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<atem:function_calls>", "<atem:invoke",
           "<atem:parameter", "</atem:parameter>", "</atem:invoke>", "</atem:function_calls>")
SPACED = (' to=functions.get_weather<|message|><atem:function_calls><atem:invoke name="get_weather">'
          '<atem:parameter name="days">3</atem:parameter>  <atem:parameter name="city">Paris, "FR"</atem:parameter>'
          '</atem:invoke>\n\n</atem:function_calls>')


@pytest.mark.parametrize("reply", [
    SPACED,
    " to=self<|message|>Weather, <b>so</b> a call.<|eom|><|start|>assistant to=self<|message|>Yes.<|eom|>"
    "<|start|>assistant to=user<|message|>Checking.<|eom|><|start|>assistant" + SPACED
    + "<|eom|><|start|>assistant to=ping<|message|><atem:function_calls>\n<atem:invoke name=\"ping\">\n</atem:invoke>\n"
      "</atem:function_calls>",
    " to=selfie<|message|>" + SPACED[SPACED.index("<atem:function_calls>"):],
])
def test_grammar_takes_messages_recipients_and_spacing_spelled_and_as_special_tokens(reply):
    ctx = Context(tools=TOOLS)
    g = M.grammar(ctx, "required")
    assert accepts(g, reply) and accepts_special(g, reply, MARKERS)
    got = M.parse(reply, ctx, partial=False).calls
    assert (got[0].name, json.loads(got[0].arguments)) == ("get_weather", {"days": 3, "city": 'Paris, "FR"'})
