"""DeepSeek V3.1, the R1 distills (jsoncalls rows) and V3.2 / V4's DSML against llama.cpp's parse of
every recorded reply, whole and streamed, and their grammars."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context
from appliance.engine.chat_formats.deepseek import DeepSeekR1, DeepSeekV31
from appliance.engine.chat_formats.dsml import Dsml, DsmlV4

from .family_cases import check_streamed, check_whole, params
from .json_family import TOOLS, calls_of, check_forced_special, forced, grammar_takes, names

TEMPLATES = ["deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
             "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1", "deepseek-ai-DeepSeek-V3.2",
             "deepseek-ai-DeepSeek-V4", "deepseek-ai-DeepSeek-V4-Flash-0731"]
CASES = params(TEMPLATES)
W, A = '{"city": "Paris"}', '{"a": 2, "b": 3.5}'
TC = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")


def test_detected_as_llama_cpp_reads_them():
    assert names(TEMPLATES) == {
        "deepseek-ai-DeepSeek-V3.1": "deepseek-v3.1", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek-r1-distill-llama",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek-r1", "llama-cpp-deepseek-r1": "deepseek-r1",
        "deepseek-ai-DeepSeek-V3.2": "deepseek-dsml", "deepseek-ai-DeepSeek-V4": "deepseek-v4-dsml",
        "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek-v4-dsml"}


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


def test_v31_reasoning_keeps_llama_cpps_whitespace_and_calls_follow_it():
    fmt, ctx = DeepSeekV31(), Context(tools=TOOLS, thinking_open=True)
    reply = f"REASONING\n</think>\n\nCONTENT{TC[0]}{TC[2]}get_weather<｜tool▁sep｜>{W}{TC[3]}{TC[1]}"
    got = fmt.parse(reply, ctx, partial=False)
    assert (got.reasoning, got.content) == ("REASONING\n", "\n\nCONTENT")
    assert calls_of(fmt, reply, ctx) == [("get_weather", {"city": "Paris"})]


def test_r1_reads_the_fenced_call_and_text_after_the_calls_stays_content():
    fmt, ctx = DeepSeekR1(), Context(tools=TOOLS)
    call = f"{TC[0]}{TC[2]}function<｜tool▁sep｜>add\n```json\n{A}\n```{TC[3]}{TC[1]}"
    assert calls_of(fmt, call, ctx) == [("add", {"a": 2, "b": 3.5})]
    got = fmt.parse(call + " more", ctx, partial=False)       # llama.cpp throws here
    assert (got.content, len(got.calls)) == (" more", 1)


def test_dsml_types_parameters_by_schema_and_reads_calls_straight_after_reasoning():
    fmt, ctx = DsmlV4(), Context(tools=TOOLS, thinking_open=True)
    reply = ('Let me check\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="add">\n'
             '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="b" string="false">3.5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    got = fmt.parse(reply, ctx, partial=False)
    assert (got.reasoning, got.content) == ("Let me check", "")
    assert calls_of(fmt, reply, ctx) == [("add", {"a": 2, "b": 3.5})]
    wrong = reply.replace('name="a" string="false"', 'name="a" string="true"')   # not the schema's: no call
    assert fmt.parse(wrong, ctx, partial=False).calls == []


def test_dsml_arguments_stream_parameter_by_parameter():
    fmt, ctx = Dsml(), Context(tools=TOOLS)
    reply = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Par"is</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="unit" string="true">C</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    args = [c[0].arguments for n in range(len(reply)) if (c := fmt.parse(reply[:n], ctx, partial=True).calls)]
    assert all(b.startswith(a) for a, b in zip(args, args[1:])) and '{"city":"Par\\"is"' in args


@pytest.mark.parametrize("fmt,text", [
    (DeepSeekV31(), f"{TC[0]}{TC[2]}get_weather<｜tool▁sep｜>{W}{TC[3]}{TC[2]}add<｜tool▁sep｜>{A}{TC[3]}{TC[1]}"),
    (DeepSeekR1(), f"{TC[0]}{TC[2]}function<｜tool▁sep｜>get_weather\n```json\n{W}```{TC[3]}"
                   f"{TC[2]}function<｜tool▁sep｜>add\n```json\n{A}```{TC[3]}{TC[1]}"),
    (Dsml(), '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '<｜DSML｜invoke name="add">\n<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="b" string="false">3.5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
])
def test_grammar_takes_the_calls_its_parse_reads(fmt, text):
    assert grammar_takes(fmt, text)


@pytest.mark.parametrize("template,case,choice", forced(TEMPLATES))
def test_forced_grammar_takes_the_replies_with_markers_as_special_tokens(template, case, choice):
    check_forced_special(template, case, choice)
