"""Gemma 4's channels and calls against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.gemma4 import Gemma4

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved"]
# the template writes a null in a list as nothing (`[1,<|"|>two<|"|>,]`), which llama.cpp does not
# read back: it drops the call; streamed, the call was named before it failed and stays (stream.py)
STREAM_KNOWN = {"nested_unicode_args": "llama.cpp drops a call after its name was streamed (a null written as nothing)"}
G = Gemma4()


def test_detected_by_its_call_marker():
    assert {detect(templates.template(t)).name for t in TEMPLATES} == {"gemma4"}


@pytest.mark.parametrize("template,case", params(TEMPLATES))
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", params(TEMPLATES, STREAM_KNOWN))
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def tools(*names):
    return {n: {"type": "object"} for n in names}


@pytest.mark.parametrize("reply,names,content,reasoning,calls", [
    # llama.cpp's test-chat.cpp cases (they hold without the recorded fixture too)
    ("<|channel>thought\nI'm\nthinking<channel|>Hello", (), "Hello", "I'm\nthinking", []),
    ("<|channel>thought<channel|>Hello", (), "Hello", "", []),
    ("<|channel><|channel>thought\n<channel|>Hello<|channel>thought\n<channel|><channel|>", (), "Hello", "", []),
    ("Hi<channel|>dropped", (), "Hi", "", []),
    ('Hi<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>', ("get_time",), "Hi", "",
     [("get_time", {"city": "Paris"})]),
    ('<|tool_call>call:a{x:-7,y:1.5e10,z:[<|"|>m<|"|>,true],w:{k:null}}<tool_call|><|tool_call>call:b{}<tool_call|>',
     ("a", "b"), "", "", [("a", {"x": -7, "y": 1.5e10, "z": ["m", True], "w": {"k": None}}), ("b", {})]),
    ('<|tool_call>call:unknown{}<tool_call|>', ("a",), "<|tool_call>call:unknown{}<tool_call|>", "", []),  # kept
    ("<channel|>Hello", (), "<channel|>Hello", "", []),     # llama.cpp fails: the text stays content
])
def test_reads_thoughts_and_calls(reply, names, content, reasoning, calls):
    got = G.parse(reply, Context(tools=tools(*names)), partial=False)
    assert (got.content, got.reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_only_one_call_without_parallel_calls():
    reply = "<|tool_call>call:a{}<tool_call|><|tool_call>call:a{x:1}<tool_call|>"
    assert len(G.parse(reply, Context(tools=tools("a"), parallel=False), partial=False).calls) == 1


def test_a_call_is_given_once_closed():
    """A value still to come may make a call none at all (llama.cpp drops it), so a call streams
    whole, once its arguments have closed: never named, then taken back."""
    reply = '<|tool_call>call:a{x:1,s:<|"|>te<|"|>,n:2}<tool_call|>'
    ctx = Context(tools=tools("a"))
    first = next(n for n in range(len(reply) + 1) if G.parse(reply[:n], ctx, partial=True).calls)
    assert first == reply.index("}") + 1 and G.parse(reply, ctx, partial=True).calls[0].arguments == '{"x":1,"s":"te","n":2}'


def test_grammar_reads_back_as_the_call():
    ctx = Context(tools={"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "ping": {}})
    g = G.grammar(ctx, "required")
    call = '<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>}<tool_call|>'
    assert compiles(g) and accepts(g, call) and accepts(g, call + "<|tool_call>call:ping{}<tool_call|>")
    assert not accepts(g, "Hello") and not accepts(G.grammar(ctx, "ping"), call)
    assert not accepts(G.grammar(Context(tools=ctx.tools, parallel=False), "required"), call + call)
    got = G.parse(call, ctx, partial=False).calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_weather", {"city": 'Paris, "FR"'})]


MARKERS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>")


@pytest.mark.parametrize("reply", [
    '<|channel>thought\nA <b>plan</b>, "quoted".<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    'Let me check.\n<|tool_call>call:get_weather{ city: <|"|>Paris<|"|>, days: [1, 2.5e1, -3],'
    ' opts: {deep: {on: true, off: null}} }<tool_call|><|tool_call>call:ping{}<tool_call|><|tool_response>',
    '<|channel><|channel>thought<channel|><|tool_call>call:ping{}<tool_call|>',
])
def test_grammar_takes_thought_text_and_spacing_spelled_and_as_special_tokens(reply):
    ctx = Context(tools={"get_weather": {"type": "object"}, "ping": {}})
    g = G.grammar(ctx, "required")
    assert accepts(g, reply) and accepts_special(g, reply, MARKERS)
    assert G.parse(reply, ctx, partial=False).calls
