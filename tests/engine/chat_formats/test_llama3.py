"""Llama 3.x, FireFunction v2 and Functionary v3.1 (jsoncalls rows) against llama.cpp's parse of every
recorded reply, whole and streamed, and their grammars."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.llama3 import FireFunction, FunctionaryV31, Llama3

from .family_cases import check_streamed, check_whole, params
from .json_family import RESPONSE_FORMAT, TOOLS, calls_of, check_forced_special, forced, grammar_takes, names

TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
             "fireworks-ai-llama-3-firefunction-v2", "meetkai-functionary-medium-v3.1"]
KNOWN = {"test-chat 2": RESPONSE_FORMAT, "test-chat 3": RESPONSE_FORMAT}   # Llama 3.1's json_schema cases
CASES = params(TEMPLATES[:1], KNOWN) + params(TEMPLATES[1:])
W, A = '{"city": "Paris"}', '{"a": 2, "b": 3.5}'


def test_detected():
    assert names(TEMPLATES) == {**{t: "llama3" for t in TEMPLATES[:3]},
                                "fireworks-ai-llama-3-firefunction-v2": "firefunction-v2",
                                "meetkai-functionary-medium-v3.1": "functionary-v3.1"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_llama3_reads_one_bare_call_with_or_without_the_openai_wrapper():
    ctx = Context(tools=TOOLS, parallel=False)
    for text in (f'{{"name": "add", "parameters": {A}}}', f'{{"type": "function", "name": "add", "parameters": {A}}}'):
        assert calls_of(Llama3(), text, ctx) == [("add", {"a": 2, "b": 3.5})]
    got = Llama3().parse("Use {braces} freely", ctx, partial=False)     # llama.cpp throws: it stays content
    assert (got.content, got.calls) == ("Use {braces} freely", [])


@pytest.mark.parametrize("fmt,text,parallel", [
    (Llama3(), f'{{"name": "get_weather", "parameters": {W}}}', False),
    (FireFunction(), f'functools[{{"name": "get_weather", "arguments": {W}}}, {{"name": "add", "arguments": {A}}}]', True),
    (FunctionaryV31(), f"<function=get_weather>{W}</function><function=add>{A}</function>", True),
])
def test_grammar_takes_the_calls_its_parse_reads(fmt, text, parallel):
    assert grammar_takes(fmt, text, parallel)


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
