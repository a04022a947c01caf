"""The generic tool format (a template without tool support, as the embedded SmolLM2's: the tools
described in a system message, calls written and read as hermes `<tool_call>` JSON), whole and
streamed through the one streaming core: what stays content, what streams and when, how deep a
call may nest. The model formats of real templates are tests/engine/chat_formats/'s."""
from __future__ import annotations

import json

import pytest

from appliance import jsondepth
from appliance.engine import chat_formats, tools
from appliance.engine.chat_formats.stream import ChatStream
from appliance.engine.types import ChatMessage, ToolCall, ToolSpec

MAX_DEPTH = jsondepth.MAX_DEPTH
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
WEATHER = ToolSpec("get_weather", "Weather in a city", json.dumps(SCHEMAS["get_weather"]))
CTX = chat_formats.Context(tools=SCHEMAS)
GENERIC = chat_formats.Generic()


def whole(text: str) -> tuple[str, list[tuple[str, dict]]]:
    got = GENERIC.parse(text, CTX, partial=False)
    return got.content, [(c.name, json.loads(c.arguments)) for c in got.calls]


def stream(text: str, size: int = 3):
    """Feed `text` in pieces of `size` characters, then flush: (content, calls, parts, at), where
    `at` is how many characters had been fed when each part came out."""
    s = ChatStream(GENERIC, CTX)
    content, calls, parts, at = "", [], [], []
    for i in range(0, len(text), size):
        got = s.feed(text[i:i + size])
        content, calls, parts = content + got.content, calls + list(got.calls), parts + list(got.parts)
        at += [i + size] * len(got.parts)
    end = s.flush()
    return content + end.content, calls + list(end.calls), parts + list(end.parts), at + [len(text)] * len(end.parts)


def test_calls_come_apart_from_the_content_and_arguments_as_a_string_are_read():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"rain\\"}"}\n</tool_call>'
    assert whole(text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("search", {"q": "rain"})])
    _, calls, _, _ = stream(text)
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
                                  '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
                                  '<tool_call>\nnot json\n</tool_call>', "plain answer", "a <toolbox> b"])
def test_what_is_not_a_call_of_these_tools_stays_content_whole_and_streamed(text):
    assert whole(text) == (text, [])
    content, calls, parts, _ = stream(text)
    assert (content, calls, parts) == (text, [], [])


def test_the_generic_prompt_describes_the_tools_and_writes_earlier_calls_in_its_format():
    msgs = (ChatMessage("user", "Weather?"),
            ChatMessage("assistant", None, tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)))
    out = tools.with_generic_tools(msgs, (WEATHER,))
    assert out[0].role == "system" and "get_weather" in out[0].content and "<tool_call>" in out[0].content
    assert whole(out[2].content)[1] == [("get_weather", {"city": "Paris"})]


def test_the_grammar_compiles_for_required_and_for_one_name():
    llguidance = pytest.importorskip("llguidance")
    for choice in ("required", "get_weather"):
        ok, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(GENERIC.grammar(CTX, choice)))
        assert not ok, msgs
    assert '"const": "search"' not in GENERIC.grammar(CTX, "get_weather")


def test_a_call_streams_its_name_first_then_its_arguments_as_they_become_final():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
    content, calls, parts, at = stream(text)
    assert content == "Sure."
    head = parts[0]
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id.startswith("call_")
    assert at[0] < text.index('"city"') + 3, "the name goes out once the arguments open"
    assert all(p.id == "" and p.index == 0 for p in parts[1:]) and len(parts) >= 3
    assert "".join(p.arguments for p in parts) == '{"city": "Paris", "days": [1, 2]}'
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == \
        [(head.id, "get_weather", {"city": "Paris", "days": [1, 2]})]


def test_two_calls_are_numbered_and_strings_hide_their_braces():
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "a } b { \\" c"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    content, calls, parts, _ = stream(text, size=5)
    assert content == "" and [p.index for p in parts if p.id] == [0, 1]
    assert "".join(p.arguments for p in parts if p.index == 0) == '{"q": "a } b { \\" c"}'
    assert [json.loads(c.arguments) for c in calls] == [{"q": 'a } b { " c'}, {"city": "Rome"}]


def test_a_call_cut_off_ends_as_far_as_it_got_its_arguments_closed():
    content, calls, parts, _ = stream('<tool_call>\n{"name": "search", "arguments": {"q": "x", "n": 1')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": "x"})]
    assert "".join(p.arguments for p in parts) == calls[0].arguments     # the stream says the same
    cut = '<tool_call>\n{"name": "search", "argu'        # before its arguments opened: no call yet
    assert stream(cut)[:2] == (cut, []) and whole(cut) == (cut, [])


# -- a model may write JSON of any depth; the parser's stack cannot take all of it ---------------

def nested_args(depth: int) -> str:
    """An arguments object nesting `depth` levels in all."""
    return '{"city": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


def test_the_deepest_call_that_fits_parses_and_one_more_level_stays_content():
    deepest = '<tool_call>\n{"name": "get_weather", "arguments": ' + nested_args(MAX_DEPTH - 1) + "}\n</tool_call>"
    content, calls = whole(deepest)
    assert content == "" and jsondepth.within(calls[0][1], MAX_DEPTH - 1)
    too_deep = deepest.replace(nested_args(MAX_DEPTH - 1), nested_args(MAX_DEPTH))
    assert whole(too_deep) == (too_deep, [])


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_a_call_nested_far_too_deep_stays_content_whole_and_streamed_calls_keep_working(depth):
    args = '{"city": ' * depth + '"Paris"' + "}" * depth
    text = f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert whole(text) == (text, [])
    content, calls, _, _ = stream(text, size=4096)
    assert content.startswith("Checking.") and len(calls) <= 1     # named while it streamed: as far as it got
    assert whole('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')[1] == [("search", {"q": "x"})]
