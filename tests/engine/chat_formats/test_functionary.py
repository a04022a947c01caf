"""Functionary v3.2's recipients against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.functionary import Functionary

from ..chat_templates import cases as templates
from .byte_grammar import accepts, compiles
from .family_cases import check_streamed, check_whole, params

TEMPLATES = ["meetkai-functionary-medium-v3.2"]
CASES = params(TEMPLATES)
F = Functionary()
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "add": {}}


def test_detected_by_its_recipients():
    assert detect(templates.template("meetkai-functionary-medium-v3.2")).name == "functionary-v3.2"
    assert detect(templates.template("meetkai-functionary-medium-v3.1")).name != "functionary-v3.2"


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


@pytest.mark.parametrize("reply,content,calls", [
    ("all\nHi>>>get_weather\n{}", "Hi>>>get_weather\n{}", []),           # llama.cpp reads no call after content
    ('get_weather\n{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    # llama.cpp fails on what follows a call; the format's own reading keeps everything
    ('get_weather\n{"city": "Paris"}>>>add\n{"a": 1}>>>all\nDone', "Done",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ('add\n{"a": 1} trailing', " trailing", [("add", {"a": 1})]),
    ("nope\n{}", "nope\n{}", []),
])
def test_reads_recipients(reply, content, calls):
    got = F.parse(reply, Context(tools=TOOLS), partial=False)
    assert got.content == content and [(c.name, json.loads(c.arguments)) for c in got.calls] == calls


def test_grammar_reads_back_as_the_calls():
    ctx = Context(tools=TOOLS)
    g = F.grammar(ctx, "required")
    text = 'get_weather\n{"city": "Paris"}>>>add\n{"a": 1}'
    assert compiles(g) and accepts(g, text) and not accepts(F.grammar(ctx, "add"), text)
    assert not accepts(F.grammar(Context(tools=TOOLS, parallel=False), "required"), text)
    got = F.parse(text, ctx, partial=False).calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
