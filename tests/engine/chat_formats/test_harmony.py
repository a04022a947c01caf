"""gpt-oss's harmony format against llama.cpp's parse of every recorded reply, streamed and whole."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.harmony import Harmony

from ..chat_templates import cases as templates
from .byte_grammar import accepts, accepts_special, compiles
from .family_cases import check_streamed, check_whole, params
from .reference import chunkings, streamed

TEMPLATES = ["openai-gpt-oss-120b"]
CASES = params(TEMPLATES)
FN = {"special_function": {"type": "object", "properties": {"arg1": {"type": "integer"}}}}
H = Harmony()


def test_detected_by_its_channel_marker():
    assert detect(templates.template("openai-gpt-oss-120b")).name == "gpt-oss"
    assert not Harmony.detect("{{ '<tool_call>' }}")


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


@pytest.mark.parametrize("reply,content,reasoning,calls", [
    # llama.cpp's test-chat.cpp cases (they hold without the recorded fixture too)
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hi",
     "Hi", "I'm\nthinking", []),
    ("<|channel|>commentary<|message|>Pre<|end|><|start|>assistant<|channel|>final<|message|>Hi", "PreHi", "", []),
    (" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{\"arg1\": 1}", "", "",
     [("special_function", '{"arg1": 1}')]),
    ("<|channel|>commentary to=functions.special_function<|message|>{\"arg1\": 1}<|call|>", "", "",
     [("special_function", '{"arg1": 1}')]),
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>a<|end|><|start|>assistant"
     "<|channel|>commentary to=assistant<|channel|>final<|message|>b", "b", "a", []),
    # a builtin tool's call, not the request's: llama.cpp drops it without tools, fails with them
    ("<|channel|>analysis<|message|>t<|end|><|start|>assistant to=container.exec<|channel|>commentary"
     "<|message|>ls", "", "t", []),
    # not harmony at all (llama.cpp fails): the text stays content
    ("Just text", "Just text", "", []),
    ("<|channel|>analysis<|message|>t<|end|>then text", "then text", "t", []),
])
def test_reads_the_channels(reply, content, reasoning, calls):
    tools = FN if calls or "text" in reply else {}
    got = H.parse(reply, Context(tools=tools), partial=False)
    assert (got.content, got.reasoning, [(c.name, c.arguments) for c in got.calls]) == (content, reasoning, calls)


def test_reasoning_kept_in_the_content_when_not_extracted():
    reply = "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    got = H.parse(reply, Context(extract_reasoning=False), partial=False)
    assert got.content == "<|channel|>analysis<|message|>I'm\nthinking<|end|>Hi" and not got.reasoning


def test_a_call_streams_member_by_member_and_a_cut_one_closes():
    reply = '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": 1, "b": [2, 3]}'
    ctx = Context(tools=FN)
    seen = [H.parse(reply[:n], ctx, partial=True).calls for n in range(len(reply))]
    args = [c[0].arguments for c in seen if c]
    assert args[0] == "" and args[1] == "{" and '{"arg1": 1' in args and all(b.startswith(a) for a, b in zip(args, args[1:]))
    assert H.parse(reply[:-8], ctx, partial=False).calls[0].arguments == '{"arg1": 1}'
    for sizes in chunkings():
        assert streamed(H, ctx, reply, sizes)["tool_calls"] == [{"name": "special_function",
                                                                 "arguments": {"arg1": 1, "b": [2, 3]}}]


def test_a_marker_being_written_is_held_back():
    assert H.parse("<|channel|>final<|message|>Hello<|e", Context(), partial=True).content == "Hello"
    assert H.parse("<|channel|>analysis<|message|>Hmm <|en", Context(), partial=True).reasoning == "Hmm"
    assert H.parse("<|chan", Context(tools=FN), partial=True).content == ""


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
         "ping": {}}


def test_grammar_is_one_call_after_an_optional_analysis():
    ctx = Context(tools=TOOLS)
    g = H.grammar(ctx, "required")
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert compiles(g) and accepts(g, call)
    thought = "<|channel|>analysis<|message|>Let me call it.<|end|><|start|>assistant"
    assert accepts(g, thought + call) and accepts(g, "<|channel|>commentary to=functions.ping "
                                                      "<|constrain|>json<|message|>{}")
    assert not accepts(g, call + call) and not accepts(g, "<|channel|>final<|message|>Hi")
    assert not accepts(H.grammar(ctx, "ping"), call)
    got = H.parse(thought + call, ctx, partial=False)
    assert (got.reasoning, [(c.name, c.arguments) for c in got.calls]) == (
        "Let me call it.", [("get_weather", '{"city": "Paris"}')])


MARKERS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>")
THOUGHT = "<|channel|>analysis<|message|>Let me <think> about it.<|end|><|start|>assistant"


@pytest.mark.parametrize("reply", [
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
    THOUGHT + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
    THOUGHT + "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
              '<|channel|>analysis to=functions.get_weather<|message|>{"city": "Paris"}',
    "<|channel|>commentary to=assistant" + THOUGHT + ' to=functions.ping<|channel|>analysis <|constrain|>json<|message|>{}',
])
def test_grammar_takes_the_headers_llama_cpp_reads_spelled_and_as_special_tokens(reply):
    ctx = Context(tools=TOOLS)
    g = H.grammar(ctx, "required")
    assert accepts(g, reply) and accepts_special(g, reply, MARKERS)
    assert H.parse(reply, ctx, partial=False).calls


def test_answer_grammar_holds_the_final_message_to_the_schema_not_the_reasoning():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = H.answer_grammar(json.dumps(schema))
    assert compiles(g)
    for reply in ['<|channel|>final<|message|>{"n": 3}', '<|channel|>final <|constrain|>json<|message|>{"n": 3}',
                  THOUGHT + "<|channel|>final<|message|>{\n  \"n\": 3\n}",
                  THOUGHT + THOUGHT + "<|channel|>final<|message|>{\"n\": 3}"]:
        assert accepts(g, reply) and accepts_special(g, reply, MARKERS), reply
        got = H.parse(reply, Context(), partial=False)
        assert json.loads(got.content) == {"n": 3}
    for wrong in ['<|channel|>final<|message|>{"n": "3"}', "<|channel|>final<|message|>Three",
                  '<|channel|>analysis<|message|>{"n": 3}<|end|>',
                  '<|channel|>commentary<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>{"n": 3}']:
        assert not accepts(g, wrong) and not accepts_special(g, wrong, MARKERS), wrong
