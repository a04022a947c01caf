"""The XML call families (xml_calls.py, xml_rows.py) against llama.cpp's parse of every recorded
reply of their templates, whole and streamed, and their grammars."""
from __future__ import annotations

import json

import pytest

from appliance.engine.chat_formats import Context, detect
from appliance.engine.chat_formats.xml_calls import XmlCalls
from appliance.engine.chat_formats.xml_minimax import NS, MiniMaxM3
from appliance.engine.chat_formats.xml_rows import Glm, Glm46, Hy3, Ling3, MiniCpm5, MiniMaxM2, Qwen3Coder, SeedOss

from ..chat_templates import cases as templates
from .byte_grammar import accepts, compiles
from .family_cases import check_streamed, check_whole, params

FAMILY = {
    "Qwen3-Coder": "qwen3_coder", "Qwen3.5-4B": "qwen3_coder_thinking",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder_thinking", "StepFun3.5-Flash": "qwen3_coder_thinking",
    "ByteDance-Seed-OSS": "seed_oss", "MiniMax-M2": "minimax_m2", "openbmb-MiniCPM5-1B": "minicpm5",
    "GLM-4.6": "glm46", "GLM-4.7-Flash": "glm", "Spark2.5": "glm", "poolside-Laguna-S-2.1": "glm",
    "poolside-Laguna-XS-2.1": "glm", "poolside-Laguna-XS.2": "glm",
    "inclusionai-ling-3.0-flash": "ling3", "tencent-Hy3": "hy3", "MiniMax-M3": "minimax_m3",
}
CASES = params(FAMILY)


def test_detected_as_llama_cpp_does():
    assert {t: detect(templates.template(t)).name for t in FAMILY} == FAMILY


@pytest.mark.parametrize("template,case", CASES)
def test_whole_reply_is_llama_cpps_message(template, case):
    check_whole(template, case)


@pytest.mark.parametrize("template,case", CASES)
def test_streamed_reply_is_the_whole_one(template, case):
    check_streamed(template, case)


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "when": {"type": ["string", "integer"]}},
                         "required": ["city"]},
         "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]},
         "ping": {}}
Q = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("reply,content,calls", [
    # llama.cpp's reading (chat_ref): content before a call keeps its newline, a string keeps its text
    ("Sure.\n" + Q, "Sure.\n", [("get_weather", {"city": "Paris"})]),
    (Q.replace("Paris", "  two\n\nlines\n"), "", [("get_weather", {"city": "  two\n\nlines\n"})]),
    # typed by the schema: an integer is JSON, a string-or-integer is JSON where it reads as one
    (Q.replace("</function>", "<parameter=days>\n3\n</parameter>\n<parameter=when>\n7\n</parameter>\n</function>"),
     "", [("get_weather", {"city": "Paris", "days": 3, "when": 7})]),
    # a value that is not JSON of its type: no call; llama.cpp drops the rest, and so do we (it does not fail)
    # no call of these tools (llama.cpp drops the block): its text stays content
    (Q.replace("</function>", "<parameter=days>\nthree\n</parameter>\n</function>"),
     Q.replace("</function>", "<parameter=days>\nthree\n</parameter>\n</function>"), []),
    ("Hi " + Q.replace("get_weather", "get_wether"), "Hi " + Q.replace("get_weather", "get_wether"), []),
    # the reply ends inside a call: so far, it is one (llama.cpp's lenient parse)
    (Q[:-20], "", [("get_weather", {"city": "Paris"})]),
])
def test_qwen3_coder_values(reply, content, calls):
    got = XmlCalls().parse(reply, Context(tools=TOOLS), partial=False)
    assert (got.content, [(c.name, json.loads(c.arguments)) for c in got.calls]) == (content, calls)


def test_qwen3_coder_first_call_may_lack_its_wrap():
    got = Qwen3Coder().parse(Q[len("<tool_call>\n"):], Context(tools=TOOLS), partial=False)
    assert [c.name for c in got.calls] == ["get_weather"] and got.content == ""


G = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


@pytest.mark.parametrize("reply,content,ncalls", [
    # llama.cpp fails on these (its grammar ends the reply after the calls): no text is lost
    (G + "\nDone.", "Done.", 1),
    (G.replace("get_weather", "nope"), G.replace("get_weather", "nope"), 0),
    (G + G.replace("Paris", "Rome"), "", 2),
])
def test_automatic_parser_rows_keep_what_is_not_a_call(reply, content, ncalls):
    got = Glm().parse(reply, Context(tools=TOOLS), partial=False)
    assert got.content == content and len(got.calls) == ncalls


def _open_calls(f: XmlCalls, reply: str, ctx: Context) -> list[list[tuple[str, str, bool]]]:
    """The calls of each partial parse of `reply`, where they change."""
    out: list[list[tuple[str, str, bool]]] = []
    for i in range(len(reply) + 1):
        now = [(c.name, c.arguments, c.closed) for c in f.parse(reply[:i], ctx, partial=True).calls]
        if not out or now != out[-1]:
            out.append(now)
    return out


def test_an_open_call_is_named_once_its_required_arguments_are_read_then_grows_by_argument():
    reply = Q.replace("</function>", "<parameter=days>\n3\n</parameter>\n<parameter=when>\nnow\n</parameter>\n</function>")
    assert _open_calls(XmlCalls(), reply, Context(tools=TOOLS)) == [
        [], [("get_weather", '{"city": "Paris"', False)], [("get_weather", '{"city": "Paris", "days": 3', False)],
        [("get_weather", '{"city": "Paris", "days": 3, "when": "now"', False)],
        [("get_weather", '{"city": "Paris", "days": 3, "when": "now"}', True)]]
    add = '<minimax:tool_call><invoke name="add"><parameter name="b">2.5</parameter><parameter name="a">1</parameter>'
    assert [c[0][1] for c in _open_calls(MiniMaxM2(), add, Context(tools=TOOLS)) if c] == ['{"b": 2.5, "a": 1']


def test_a_call_is_not_given_while_a_required_argument_may_still_fail():
    """A call whose required argument does not read (a bad value) is never given: not while open,
    not whole. (An optional argument that fails after the call was named leaves the stream with
    the call, as llama-server's stream does, while the whole reply has none.)"""
    reply = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nhalf\n</parameter>\n"
             "</function>\n</tool_call>")
    assert XmlCalls().parse(reply, Context(tools=TOOLS), partial=False).calls == []
    assert _open_calls(XmlCalls(), reply, Context(tools=TOOLS)) == [[]]


def test_minimax_m2_section_of_several_invokes():
    reply = ('<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
             '<parameter name="b">2.5</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n</minimax:tool_call>')
    got = MiniMaxM2().parse(reply, Context(tools=TOOLS), partial=False)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("add", {"a": 1, "b": 2.5}), ("ping", {})]


def test_minicpm5_cdata_value():
    reply = '<function name="get_weather"><param name="city"><![CDATA[a </param> b]]></param></function>'
    got = MiniCpm5().parse(reply, Context(tools=TOOLS), partial=False)
    assert json.loads(got.calls[0].arguments) == {"city": "a </param> b"}


FAMILIES = [XmlCalls, Qwen3Coder, SeedOss, MiniMaxM2, MiniCpm5, Glm, Glm46, Ling3, Hy3]


def _canonical(f: XmlCalls, calls: list[tuple[str, dict]], parallel: bool) -> str:
    """Calls written in the row's own layout (what its grammar describes)."""
    sep, out = ("\n" if f.flex else ""), []
    for name, args in calls:
        t = f.call[0] + name + f.call[1]
        for k, v in args.items():
            t += sep + f.arg[0] + k + f.arg[1] + sep + f.arg[2] + (v if isinstance(v, str) else json.dumps(v)) + f.arg[3]
        t += sep + f.call[2] if f.call[2] else ""
        out.append(f.wrap[0] + sep + t + sep + f.wrap[1] if f.wrap[0] else t)
    if f.section:
        return f.section[0] + sep + sep.join(out) + sep + f.section[1]
    return "\n".join(out)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_compiles_takes_a_call_and_reads_back(family, parallel):
    f, ctx = family(), Context(tools=TOOLS, parallel=parallel)
    calls = [("get_weather", {"city": "Paris <b>", "days": 2}), ("add", {"a": 2, "b": 3.5})][: 2 if parallel else 1]
    text = _canonical(f, calls, parallel)
    grammar = f.grammar(ctx, "required")
    assert compiles(grammar) and accepts(grammar, text)
    assert [(c.name, json.loads(c.arguments)) for c in f.parse(text, ctx, partial=False).calls] == calls
    one = f.grammar(ctx, "add")
    assert accepts(one, _canonical(f, [("add", {"a": 1, "b": 2})], False))
    assert not accepts(one, _canonical(f, calls[:1], False))


M3_TOOLS = {"plan": {"type": "object", "required": ["when", "tags"], "properties": {
    "when": {"type": "object", "required": ["day"], "properties": {"day": {"type": "integer"}, "note": {"type": "string"}}},
    "tags": {"type": "array", "items": {"type": "string"}},
    "limit": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"max": {"type": "integer"}}}]}}}}
M3_CALL = (f'{NS}<tool_call>\n{NS}<invoke name="plan">{NS}<when>{NS}<day>3{NS}</day>{NS}<note>a <b>{NS}</note>{NS}</when>'
           f'{NS}<tags>{NS}<item>x{NS}</item>{NS}<item>y{NS}</item>{NS}</tags>{NS}<limit>{NS}<max>5{NS}</max>{NS}</limit>'
           f'{NS}</invoke>\n{NS}</tool_call>')


def test_minimax_m3_nested_values_by_schema():
    got = MiniMaxM3().parse("</mm:think>" + M3_CALL, Context(tools=M3_TOOLS), partial=False)
    assert got.content == "" and [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("plan", {"when": {"day": 3, "note": "a <b>"}, "tags": ["x", "y"], "limit": {"max": 5}})]


def test_minimax_m3_grammar():
    grammar = MiniMaxM3().grammar(Context(tools=M3_TOOLS), "required")
    assert compiles(grammar) and accepts(grammar, M3_CALL)
    assert not accepts(grammar, M3_CALL.replace("<day>3", "<day>three"))


# --- the grammars under a forced choice, with the markers as special tokens ------------------------

def _special_vocab(markers: list[str]):
    """The 256 bytes, an end of text, and `markers` as special tokens (as a model's vocabulary has them)."""
    import llguidance

    class Vocab:
        eos_token_id, bos_token_id = 256, None
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"] + [m.encode() for m in markers]
        special_token_ids = list(range(256, 257 + len(markers)))

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def _takes_with_specials(grammar: str, markers: list[str], text: str) -> bool:
    """`text`, its markers written as special tokens, is a whole sentence of `grammar` once
    special_tokens.py has named those tokens in it."""
    import re

    import llguidance

    from appliance.engine.output.special_tokens import with_special_tokens

    rx = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
    lark = with_special_tokens(grammar, lambda t: [(m, 257 + markers.index(m)) for m in rx.findall(t)])
    m = llguidance.LLMatcher(_special_vocab(markers), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    ids, pos = [], 0
    for hit in rx.finditer(text):
        ids += list(text[pos:hit.start()].encode()) + [257 + markers.index(hit.group())]
        pos = hit.end()
    ids += list(text[pos:].encode())
    return m.consume_tokens(ids) and m.is_accepting()


GLM_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]


@pytest.mark.parametrize("family,open_,markers,reply", [
    (XmlCalls, True, ["<think>", "</think>", "<tool_call>", "</tool_call>"],
     "Let me think.\n</think>\n\nSure.\n\n" + Q),
    (XmlCalls, False, ["<think>", "</think>", "<tool_call>", "</tool_call>"], "<think>\nhm\n</think>\n" + Q + "\n"),
    (Glm, True, GLM_MARKERS, "The user wants it.</think>Checking." + G),
    (Glm, False, GLM_MARKERS, "\n<think></think>\n" + G.replace("<arg_key>", "\n<arg_key>")),
    (MiniMaxM2, True, ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"],
     'x</think>\n\n<minimax:tool_call>\n<invoke name="add">\n<parameter name="b">2.5</parameter>\n'
     '<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>'),
])
def test_grammar_takes_reasoning_text_and_a_call_spelled_or_as_special_tokens(family, open_, markers, reply):
    f, ctx = family(), Context(tools=TOOLS, thinking_open=open_)
    grammar = f.grammar(ctx, "required")
    assert accepts(grammar, reply), "spelled out"
    assert _takes_with_specials(grammar, markers, reply), "as special tokens"
    assert f.parse(reply, ctx, partial=False).calls


@pytest.mark.parametrize("reply,ok", [
    # required arguments in any order (llama.cpp's permute), each once; JSON with whitespace around it
    ("<tool_call>add<arg_key>b</arg_key><arg_value> 2.5\n</arg_value><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", True),
    ("<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", False),
    ("<tool_call>add<arg_key>a</arg_key><arg_value>x</arg_value><arg_key>b</arg_key><arg_value>1</arg_value></tool_call>", False),
])
def test_grammar_arguments_any_order_typed_by_schema(reply, ok):
    assert accepts(Glm().grammar(Context(tools=TOOLS), "add"), reply) == ok


def test_llguidance_takes_no_special_token_as_stop():
    """Why xml_grammar writes `until` as two alternatives rather than a `stop=` rule: llguidance
    refuses a special token as a stop value."""
    import llguidance

    lark = 'start: thought "x"\nthought[stop=</think>]: /(?s:.*)/\n'
    m = llguidance.LLMatcher(_special_vocab(["</think>"]), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert m.is_error() and "special tokens" in m.get_error()
