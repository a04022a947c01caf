"""The other templates llama.cpp reads with its automatic parser (jsoncalls rows: Hermes-style tags,
Qwen3 and its kin, Apertus, Apriel, Granite, Solar, and the templates without calls) against
llama.cpp's parse of every recorded reply, whole and streamed, and their grammars."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.json_lists import Apertus, Apriel15, Hermes, QwQ, Qwen3, Solar

from .family_cases import check_streamed, check_whole, params
from .json_family import TOOLS, check_forced_special, forced, grammar_takes, names

TEMPLATES = {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes-json",
             "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes-json", "Qwen-Qwen2.5-7B-Instruct": "hermes-json",
             "MiMo-VL": "hermes-json", "ibm-granite-granite-4.0": "granite4", "ibm-granite-granite-4.1": "granite4",
             "Qwen-Qwen3-0.6B": "qwen3", "Qwen-QwQ-32B": "qwq", "Bielik-11B-v3.0-Instruct": "bielik",
             "Reka-Edge": "reka-edge", "Apertus-8B-Instruct": "apertus", "unsloth-Apriel-1.5": "apriel-1.5",
             "Apriel-1.6-15b-Thinker-fixed": "apriel-1.6", "upstage-Solar-Open-100B": "solar-open",
             "HuggingFaceTB-SmolLM3-3B": "smollm3", "ibm-granite-granite-3.3-2B-Instruct": "granite3.3",
             "google-gemma-2-2b-it": "gemma2", "microsoft-Phi-3.5-mini-instruct": "phi3.5",
             "llama-cpp-rwkv-world": "rwkv-world", "MiniMax-M1": "minimax-m1", "NVIDIA-Nemotron-Nano-v2": "nemotron-v2"}
# SmolLM3's thinking-off generation prompt ends "<think>\n\n</think>\n": llama.cpp parses it with the
# reply, so its last "\n" begins the content; the parse context says only that thinking is not open
KNOWN = {"plain_thinking_off": "the thinking-off generation prompt's text after </think> is content in llama.cpp"}
# MiniMax-M1 writes one call a section: llama.cpp fails on a second object after the first (no comma),
# and the whole reply stays content, where a stream has sent the first call before the second came
M1_KNOWN = {"two_calls": "llama.cpp fails on a second call in the section; a stream sent the first before"}
SPECIAL = {"HuggingFaceTB-SmolLM3-3B": KNOWN, "MiniMax-M1": M1_KNOWN}
CASES = params([t for t in TEMPLATES if t not in SPECIAL]) + [p for t, k in SPECIAL.items() for p in params([t], k)]
W, A = '{"city": "Paris"}', '{"a": 2, "b": 3.5}'


def test_detected():
    assert names(list(TEMPLATES)) == TEMPLATES


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_whitespace_is_llama_cpps_and_the_prompts_open_thinking_is_read():
    ctx = Context(tools=TOOLS, thinking_open=True)
    got = QwQ().parse('I think\n</think>\n\nHi <tool_call>\n{"name": "add", "arguments": ' + A + "}</tool_call>",
                      ctx, partial=False)
    assert (got.reasoning, got.content, [c.name for c in got.calls]) == ("\nI think\n", "\n\nHi ", ["add"])
    got = Qwen3().parse("<think>\nI think\n</think>\n\nHello ", Context(tools=TOOLS), partial=False)
    assert (got.reasoning, got.content) == ("I think\n", "Hello ")


def test_a_call_of_no_known_tool_and_text_after_calls_stay_content():
    text = '<tool_call>\n{"name": "nope", "arguments": {}}</tool_call>'
    assert Hermes().parse(text, Context(tools=TOOLS), partial=False).content == text
    got = Hermes().parse(f'<tool_call>\n{{"name": "add", "arguments": {A}}}</tool_call>\nDone.',
                         Context(tools=TOOLS), partial=False)
    assert (got.content, [c.name for c in got.calls]) == ("\nDone.", ["add"])


def test_arguments_stream_member_by_member():
    reply = f'<tool_call>\n{{"name": "add", "arguments": {A}}}</tool_call>'
    args = [c[0].arguments for n in range(len(reply)) if (c := Hermes().parse(reply[:n], Context(tools=TOOLS), True).calls)]
    assert args[0] == "" and '{"a": 2' in args and all(b.startswith(a) for a, b in zip(args, args[1:]))


@pytest.mark.parametrize("fmt,text", [
    (Hermes(), f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}</tool_call>'
               f'<tool_call>\n{{"name": "add", "arguments": {A}}}</tool_call>'),
    (Apertus(), f'<|tools_prefix|>[{{"get_weather": {W}}}, {{"add": {A}}}]<|tools_suffix|>'),
    (Apriel15(), f'<tool_calls>[{{"name": "get_weather", "arguments": {W}}}, {{"name": "add", "arguments": {A}}}]</tool_calls>'),
    (Solar(), f"<|tool_calls|><|tool_call:begin|>call00001<|tool_call:name|>get_weather<|tool_call:args|>{W}"
              f"<|tool_call:end|><|tool_call:begin|>call00001<|tool_call:name|>add<|tool_call:args|>{A}"
              f"<|tool_call:end|><|calls|>"),
])
def test_grammar_takes_the_calls_its_parse_reads(fmt, text):
    assert grammar_takes(fmt, text)


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
