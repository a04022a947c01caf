"""Command R7B, Command R+ (jsoncalls rows) and Cohere2 MoE against llama.cpp's parse of every
recorded reply, whole and streamed, and their grammars."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.cohere import Cohere2MoE, CommandR7B, CommandRPlus

from .family_cases import check_streamed, check_whole, params
from .json_family import TOOLS, check_forced_special, forced, grammar_takes, names

TEMPLATES = ["CohereForAI-c4ai-command-r7b-12-2024-tool_use", "CohereForAI-c4ai-command-r-plus-tool_use", "Cohere2MoE"]
CASES = params(TEMPLATES)
W, A = '{"city": "Paris"}', '{"a": 2, "b": 3.5}'
ACTION = (f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {W}}}, '
          f'{{"tool_call_id": "1", "tool_name": "add", "parameters": {A}}}]<|END_ACTION|>')


def test_detected():
    assert names(TEMPLATES) == {TEMPLATES[0]: "command-r7b", TEMPLATES[1]: "command-r-plus", "Cohere2MoE": "cohere2moe"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_r7b_content_is_the_response_and_ids_are_read():
    got = CommandR7B().parse("<|START_THINKING|>hmm<|END_THINKING|>" + ACTION, Context(tools=TOOLS), partial=False)
    assert got.reasoning == "hmm" and [(c.name, c.id) for c in got.calls] == [("get_weather", "0"), ("add", "1")]
    got = CommandR7B().parse("<|START_RESPONSE|>Hi there<|END_RESPONSE|>", Context(), partial=False)
    assert got.content == "Hi there"


def test_cohere2moe_reasoning_is_opened_by_the_prompt():
    fmt = Cohere2MoE()
    assert fmt.prompt_opens_thinking("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>")
    got = fmt.parse("I'm thinking<|END_THINKING|><|START_TEXT|>Hello<|END_TEXT|>",
                    Context(tools=TOOLS, thinking_open=True), partial=False)
    assert (got.reasoning, got.content) == ("I'm thinking", "Hello")


@pytest.mark.parametrize("fmt,text", [
    (CommandR7B(), ACTION.replace('"1"', '"0"')),
    (Cohere2MoE(), ACTION.replace('"1"', '"0"')),
    (CommandRPlus(), f'Action:\n```json\n[{{"tool_name": "get_weather", "parameters": {W}}}, '
                     f'{{"tool_name": "add", "parameters": {A}}}]```'),
])
def test_grammar_takes_the_calls_its_parse_reads(fmt, text):
    assert grammar_takes(fmt, text)


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
