"""Mistral Small 3.2, Nemo (jsoncalls rows), Ministral 3 and Devstral (llama.cpp's ministral3 parser)
against llama.cpp's parse of every recorded reply, whole and streamed, and their grammars."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.mistral import Ministral3, MistralNemo, MistralSmall

from .family_cases import check_streamed, check_whole, params
from .json_family import RESPONSE_FORMAT, TOOLS, calls_of, check_forced_special, forced, grammar_takes, names

TEMPLATES = ["Mistral-Small-3.2-24B-Instruct-2506", "unsloth-mistral-Devstral-Small-2507",
             "mistralai-Mistral-Nemo-Instruct-2407", "mistralai-Ministral-3-14B-Reasoning-2512"]
KNOWN = {"test-chat 7": RESPONSE_FORMAT}     # Ministral 3's ```json fenced response format
CASES = params(TEMPLATES[:3]) + params(TEMPLATES[3:], KNOWN)
W, A = '{"city": "Paris"}', '{"a": 2, "b": 3.5}'


def test_detected_as_llama_cpp_reads_them():
    assert names(TEMPLATES) == {"Mistral-Small-3.2-24B-Instruct-2506": "mistral-small-3.2",
                                "unsloth-mistral-Devstral-Small-2507": "ministral3",
                                "mistralai-Mistral-Nemo-Instruct-2407": "mistral-nemo",
                                "mistralai-Ministral-3-14B-Reasoning-2512": "ministral3"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_small_reads_the_optional_call_id():
    got = MistralSmall().parse(f"Hi [TOOL_CALLS]get_weather[CALL_ID]123456789[ARGS]{W}[TOOL_CALLS]add[ARGS]{A}",
                               Context(tools=TOOLS), partial=False)
    assert got.content == "Hi " and [(c.name, c.id) for c in got.calls] == [("get_weather", "123456789"), ("add", None)]


def test_nemo_takes_calls_only_with_their_id_as_llama_cpp():
    fmt = MistralNemo()
    assert calls_of(fmt, f'[TOOL_CALLS][{{"name": "add", "arguments": {A}, "id": "123456789"}}]') == [
        ("add", {"a": 2, "b": 3.5})]
    no_id = f'[TOOL_CALLS][{{"name": "add", "arguments": {A}}}]'       # llama.cpp throws: it stays content
    assert fmt.parse(no_id, Context(tools=TOOLS), partial=False).content == no_id


def test_ministral_reasoning_then_calls():
    got = Ministral3().parse(f"[THINK]hmm[/THINK] ok[TOOL_CALLS]add[ARGS]{A}", Context(tools=TOOLS), partial=False)
    assert (got.reasoning, got.content, [c.name for c in got.calls]) == ("hmm", "ok", ["add"])


@pytest.mark.parametrize("fmt,text", [
    (MistralSmall(), f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]add[ARGS]{A}"),
    (Ministral3(), f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]add[ARGS]{A}"),
    (MistralNemo(), f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}, "id": "0"}}, '
                    f'{{"name": "add", "arguments": {A}, "id": "0"}}]'),
])
def test_grammar_takes_the_calls_its_parse_reads(fmt, text):
    assert grammar_takes(fmt, text)


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
