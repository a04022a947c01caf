"""Tool-call formats: detection from templates, whole and streamed parsing, constraining grammars."""
from __future__ import annotations

import json

import pytest

from appliance import jsondepth
from appliance.engine import tool_stream, tools
from appliance.engine.output.parser import OutputParser
from appliance.engine.types import ChatMessage, ToolCall, ToolSpec

from .test_templates import LLAMA31, MISTRAL_V03, QWEN25

MAX_DEPTH = jsondepth.MAX_DEPTH

NAMES = {"get_weather", "search"}
WEATHER = ToolSpec("get_weather", "Weather in a city",
                   json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
SEARCH = ToolSpec("search", "Search the web", json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}))


def test_format_detected_from_the_template():
    assert tools.detect_format(QWEN25) == "hermes"
    assert tools.detect_format(MISTRAL_V03) == "mistral"
    assert tools.detect_format(LLAMA31) == "llama3"
    assert tools.detect_format(None) == "generic"


def test_hermes_parse_splits_content_and_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"rain\\"}"}\n</tool_call>'
    content, calls = tools.parse(text, "hermes", NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("search", {"q": "rain"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
                                  '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
                                  '<tool_call>\nnot json\n</tool_call>', "plain answer", '<tool_call>{"name": "search"'])
def test_what_does_not_parse_stays_content(text):
    assert tools.parse(text, "hermes", NAMES) == (text, [])


def test_llama3_and_mistral_parse():
    content, calls = tools.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "llama3", NAMES)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = tools.parse('[TOOL_CALLS] [{"name": "search", "arguments": {"q": "x"}}, '
                                 '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "mistral", NAMES)
    assert [c.name for c in calls] == ["search", "get_weather"]
    assert tools.parse("Hello there", "llama3", NAMES) == ("Hello there", [])


def feed_all(parser, pieces):
    content, calls = "", []
    for p in pieces:
        got = parser.feed(p)
        content += got.content
        calls += got.calls
    end = parser.flush()
    return content + end.content, calls + list(end.calls)


def test_stream_parser_holds_back_calls_and_streams_content():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done.'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    parser = tool_stream.StreamParser("hermes", NAMES)
    streamed = [parser.feed(p) for p in pieces]
    assert all("<" not in s.content for s in streamed), "no part of the markup leaks as content"
    call_at = next(i for i, s in enumerate(streamed) if s.calls)
    assert call_at < len(pieces) - 2, "the call is emitted as soon as it closes"
    content = "".join(s.content for s in streamed) + parser.flush().content
    assert content == "Sure.  Done." and parser.n_calls == 1


def test_stream_parser_releases_text_that_only_looked_like_a_call():
    assert feed_all(tool_stream.StreamParser("hermes", NAMES), ["a <tool", "box> b"]) == ("a <toolbox> b", [])
    assert feed_all(tool_stream.StreamParser("llama3", NAMES), ["Hi", " there"]) == ("Hi there", [])
    content, calls = feed_all(tool_stream.StreamParser("llama3", NAMES), ['{"name": "search", ', '"parameters": {"q": "a"}}'])
    assert content == "" and calls[0].name == "search"


def test_generic_prompt_describes_tools_and_rewrites_history():
    msgs = (ChatMessage("user", "Weather?"),
            ChatMessage("assistant", None, tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)))
    out = tools.with_generic_tools(msgs, (WEATHER,))
    assert out[0].role == "system" and "get_weather" in out[0].content and "<tool_call>" in out[0].content
    assert tools.parse(out[2].content, "hermes", NAMES)[1][0].name == "get_weather"


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_grammars_compile_and_accept_a_valid_call(fmt):
    llguidance = pytest.importorskip("llguidance")
    for choice in ("required", "get_weather"):
        g = tools.grammar((WEATHER, SEARCH), choice, True, fmt)
        ok, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g)
        assert not ok, msgs
    assert '"const": "search"' not in tools.grammar((WEATHER, SEARCH), "get_weather", False, "hermes")


# -- a model may write JSON of any depth; the parser's stack cannot take all of it ---------------

def deep_calls(depth: int) -> dict[str, str]:
    """A call of get_weather in each format whose arguments nest `depth` levels (in an object,
    and as a string of JSON)."""
    args = '{"city": ' * depth + '"Paris"' + "}" * depth
    return {"hermes": f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
            "hermes as a string": f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}'
                                  "\n</tool_call>",
            "llama3": f'<|python_tag|>{{"name": "get_weather", "parameters": {args}}}',
            "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {args}}}]'}


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("kind", list(deep_calls(1)))
def test_a_call_nested_too_deep_stays_content_whole_and_streamed(depth, kind):
    """Parsed whole, a call nested past jsondepth's limit stays content. Streamed, a hermes call
    was already sent as a call when the nesting grew (its name goes out first): it stays one,
    its arguments the text as written (every translation that parses them reads them safely)."""
    text, fmt = deep_calls(depth)[kind], kind.split()[0]
    assert tools.parse(text, fmt, NAMES) == (text, [])
    parser = OutputParser(None, tool_stream.StreamParser(fmt, NAMES))
    pieces = [parser.feed(text[i:i + 4096]) for i in range(0, len(text), 4096)] + [parser.flush()]
    if kind.startswith("hermes"):
        calls = [c for p in pieces for c in p.calls]
        args = '{"city": ' * depth + '"Paris"' + "}" * depth
        assert "".join(p.content for p in pieces) == text[:text.index("<")] and parser.n_calls == 1
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", args)]
        assert "".join(x.arguments for p in pieces for x in p.parts) == args
    else:
        assert "".join(p.content for p in pieces) == text and not any(p.calls or p.parts for p in pieces)
        assert parser.n_calls == 0
    # the parser is not left broken: the next call parses
    assert tools.parse(deep_calls(2)[kind], fmt, NAMES)[1][0].name == "get_weather"


def test_the_deepest_call_that_fits_parses_and_one_more_level_does_not():
    deepest = '<tool_call>\n{"name": "get_weather", "arguments": ' + nested_args(MAX_DEPTH - 1) + "}\n</tool_call>"
    content, calls = tools.parse(deepest, "hermes", NAMES)
    assert content == "" and jsondepth.within(json.loads(calls[0].arguments), MAX_DEPTH - 1)
    too_deep = deepest.replace(nested_args(MAX_DEPTH - 1), nested_args(MAX_DEPTH))
    assert tools.parse(too_deep, "hermes", NAMES) == (too_deep, [])


def nested_args(depth: int) -> str:
    """An arguments object nesting `depth` levels in all."""
    return '{"city": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


# -- calls streamed as the model writes them (hermes, generic) --------------------------------------

def stream(parser, text, size=3):
    """Feed `text` in pieces of `size` characters, then flush: (content, calls, parts, at), where
    `at` is how many characters had been fed when each part came out."""
    content, calls, parts, at = "", [], [], []
    for i in range(0, len(text), size):
        got = parser.feed(text[i:i + size])
        content, calls, parts = content + got.content, calls + list(got.calls), parts + list(got.parts)
        at += [i + size] * len(got.parts)
    end = parser.flush()
    return content + end.content, calls + list(end.calls), parts + list(end.parts), at + [len(text)] * len(end.parts)


def test_a_call_streams_its_name_first_then_its_arguments_as_written():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call> Done.'
    content, calls, parts, at = stream(tool_stream.StreamParser("hermes", NAMES), text)
    assert content == "Sure.  Done."
    head = parts[0]
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id.startswith("call_")
    assert at[0] < text.index('"city"') + 3, "the name goes out as soon as the arguments open"
    assert all(p.id == "" and p.index == 0 for p in parts[1:]) and len(parts) > 3
    assert "".join(p.arguments for p in parts) == '{"city": "Paris", "days": [1, 2]}'
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [(head.id, "get_weather", {"city": "Paris", "days": [1, 2]})]


def test_two_calls_are_numbered_and_strings_hide_their_braces():
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "a } b { \\" c"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    parser = tool_stream.StreamParser("hermes", NAMES)
    content, calls, parts, _ = stream(parser, text, size=5)
    assert content.strip() == "" and parser.n_calls == 2
    assert [p.index for p in parts if p.id] == [0, 1]
    assert "".join(p.arguments for p in parts if p.index == 0) == '{"q": "a } b { \\" c"}'
    assert [json.loads(c.arguments) for c in calls] == [{"q": 'a } b { " c'}, {"city": "Rome"}]


def test_a_call_cut_off_ends_as_far_as_it_got():
    parser = tool_stream.StreamParser("hermes", NAMES)
    content, calls, parts, _ = stream(parser, '<tool_call>\n{"name": "search", "arguments": {"q": "unfini')
    assert content == "" and parser.n_calls == 1
    assert [(c.name, c.arguments) for c in calls] == [("search", '{"q": "unfini')]
    # the arguments closed but not the call: complete all the same
    content, calls, _, _ = stream(tool_stream.StreamParser("hermes", NAMES),
                                  '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}')
    assert content == "" and json.loads(calls[0].arguments) == {"q": "x"}


def test_the_name_goes_out_when_it_closes_before_the_arguments_are_written():
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    _, calls, parts, at = stream(tool_stream.StreamParser("hermes", NAMES), text, size=1)
    assert parts[0].name == "search" and at[0] == text.index('",') + 2       # at `",`, not `"arguments": {`
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": "x"})]


@pytest.mark.parametrize("text, args", [
    ('<tool_call>\n{"name": "search", "argu', ""),                              # cut off after the name
    ('<tool_call>\n{"name": "search", "arguments": "q=x"}\n</tool_call>', "q=x"),  # not JSON: as written
    ('<tool_call>\n{"name": "search", "arguments": [1, 2]}\n</tool_call>', "[1, 2]")])
def test_a_call_whose_name_went_out_stays_a_call(text, args):
    parser = tool_stream.StreamParser("hermes", NAMES)
    content, calls, parts, _ = stream(parser, text)
    assert content == "" and parser.n_calls == 1 and parts[0].name == "search"
    assert [(c.id, c.name, c.arguments) for c in calls] == [(parts[0].id, "search", args)]
    assert "".join(p.arguments for p in parts) == args


@pytest.mark.parametrize("text,is_call", [
    ('<tool_call>\n{"name": "unknown", "arguments": {"a": 1}}\n</tool_call> after', False),
    ('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call> after', True),
    ('<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call> after', True),
    ("<tool_call>\nnot json\n</tool_call> after", False)])
def test_what_cannot_stream_is_parsed_whole_at_its_close(text, is_call):
    parser = tool_stream.StreamParser("hermes", NAMES)
    pieces = [parser.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    content = "".join(p.content for p in pieces) + parser.flush().content
    got = [p for p in pieces if p.calls]
    assert bool(got) == is_call
    if is_call:
        assert content == " after" and json.loads(got[0].calls[0].arguments) == {"q": "x"}
        parts = [x for p in pieces for x in p.parts]
        assert [(x.index, bool(x.id)) for x in parts] == [(0, True), (0, False)]   # head, then the whole arguments
    else:
        assert content == text and not any(p.parts for p in pieces)
