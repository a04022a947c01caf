"""GigaChat 3 and 3.1's calls against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.gigachat import GigaChat, GigaChat31

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B"]
CASES = params(TEMPLATES)
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "ping": {}}
V3 = "<|message_sep|>\n\nfunction call<|role_sep|>\n"


def test_detected_each_by_its_marker():
    assert [detect(templates.template(t)).name for t in TEMPLATES] == ["gigachat-v3", "gigachat-3.1"]


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


@pytest.mark.parametrize("fmt,reply,content,calls", [
    (GigaChat(), 'Hi' + V3 + '{ "name" : "get_weather",\n"arguments": {"city": "Paris"} }', "Hi",
     [("get_weather", {"city": "Paris"})]),
    (GigaChat31(), 'Hi<|function_call|>{"name": "ping", "arguments": {}} and more', "Hi", [("ping", {})]),
    (GigaChat(), "Hi<|message_sep|>\n\nsomething else", "Hi", []),        # dropped, as llama.cpp drops it
    (GigaChat31(), '<|function_call|>{"name": "nope", "arguments": {}}', "", []),
])
def test_reads_the_call(fmt, reply, content, calls):
    got = fmt.parse(reply, Context(tools=TOOLS), partial=False)
    assert got.content == content and [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_a_call_streams_and_a_cut_one_closes():
    fmt, ctx = GigaChat31(), Context(tools=TOOLS)
    reply = '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "n": 2}}'
    args = [c[0].arguments for n in range(len(reply) + 1) if (c := fmt.parse(reply[:n], ctx, partial=True).calls)]
    assert args[0] == "" and '{"city": "Paris"' in args and all(b.startswith(a) for a, b in zip(args, args[1:]))
    assert fmt.parse(reply[:-6], ctx, partial=False).calls[0].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("fmt", [GigaChat(), GigaChat31()])
def test_grammar_reads_back_as_the_call(fmt):
    ctx = Context(tools=TOOLS)
    g = fmt.grammar(ctx, "required")
    text = fmt.opener + '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert compiles(g) and accepts(g, text) and not accepts(fmt.grammar(ctx, "ping"), text)
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse(text, ctx, partial=False).calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("fmt", [GigaChat(), GigaChat31()])
@pytest.mark.parametrize("before", ["", "Let me <check>\nthe weather.\n\n"])
def test_grammar_takes_content_before_the_call_spelled_and_as_special_tokens(fmt, before):
    ctx = Context(tools=TOOLS)
    g = fmt.grammar(ctx, "required")
    text = before + fmt.opener + '{ "name" : "get_weather",\n "arguments": { "city": "Paris" } }'
    markers = ("<|message_sep|>", "<|role_sep|>", "<|function_call|>")
    assert accepts(g, text) and accepts_special(g, text, markers)
    got = fmt.parse(text, ctx, partial=False)
    assert (got.content, [(c.name, json.loads(c.arguments)) for c in got.calls]) == (
        before, [("get_weather", {"city": "Paris"})])
