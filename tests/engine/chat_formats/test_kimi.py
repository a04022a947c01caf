"""Kimi K2's calls against llama.cpp's parse of every recorded reply, whole and streamed; its ids
and grammar."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.kimi import KimiK2

from .family_cases import check_streamed, check_whole, params
from .json_family import TOOLS, check_forced_special, forced, grammar_takes, names

TEMPLATES = ["moonshotai-Kimi-K2", "Kimi-K2-Instruct", "Kimi-K2-Thinking"]
CASES = params(TEMPLATES)
CALL = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 2, "b": 3.5}<|tool_call_end|>')


def test_detected():
    assert set(names(TEMPLATES).values()) == {"kimi-k2"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_ids_are_the_formats_own_and_reasoning_ends_at_the_first_call():
    reply = f"<think>hmm<|tool_calls_section_begin|>{CALL}<|tool_calls_section_end|>"
    got = KimiK2().parse(reply, Context(tools=TOOLS), partial=False)
    assert got.reasoning == "hmm" and [c.id for c in got.calls] == ["functions.get_weather:0", "functions.add:1"]


def test_grammar_takes_the_calls_its_parse_reads():
    assert grammar_takes(KimiK2(), f"<|tool_calls_section_begin|>{CALL}<|tool_calls_section_end|>")


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
