"""The shipped prompt sets and their loader: every set loads and validates, the filler is
deterministic and cut at paragraph boundaries, nonces and padding copy rather than mutate."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from appliance.bench import prompt_sets as ps
from appliance.bench.prompt_sets import Prompt, PromptSet, UnknownPromptSet

TOOL_KINDS = {"tool-calls"}


@pytest.fixture(scope="module")
def sets() -> dict[str, PromptSet]:
    return {name: ps.load(name) for name in ps.DEFAULT_SETS}


def test_every_default_set_is_shipped_and_loads(sets):
    assert ps.DEFAULT_SETS == ("prose", "code", "editing-code", "tool-calls", "repetitive",
                               "multilingual", "long-document")
    assert set(ps.DEFAULT_SETS) <= set(ps.names())
    assert ps.names() == sorted(ps.names())
    for name, s in sets.items():
        assert isinstance(s, PromptSet) and s.name == name
        assert s.description.strip() and s.prompts
        assert all(isinstance(p, Prompt) for p in s.prompts)
        assert len({p.id for p in s.prompts}) == len(s.prompts)


def test_sizes_match_the_brief(sets):
    for name, s in sets.items():
        assert len(s.prompts) == (3 if name == "long-document" else 6), name


def test_kinds_are_distinct(sets):
    kinds = [s.kind for s in sets.values()]
    assert len(set(kinds)) == len(kinds)


def test_loaded_objects_are_frozen(sets):
    s = sets["prose"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"
    assert isinstance(s.prompts, tuple) and isinstance(s.prompts[0].messages, tuple)


def test_every_prompt_passes_validation(sets):
    for s in sets.values():
        for p in s.prompts:
            ps.check_messages(list(p.messages), list(p.tools) if p.tools else None)
            assert any(m["role"] == "user" for m in p.messages)
            assert p.messages[-1]["role"] == "user"
            json.dumps(p.messages)      # plain JSON, ready to send


def test_tool_call_prompts_have_tools_and_others_do_not(sets):
    for s in sets.values():
        for p in s.prompts:
            if s.kind in TOOL_KINDS:
                assert p.tools, p.id
                names = {t["function"]["name"] for t in p.tools}
                assert {"read_file", "write_file", "run_shell", "search_code"} <= names
            else:
                assert p.tools is None, p.id
    # some agent turns carry earlier calls and their results, some of them a few hundred tokens
    tool_prompts = sets["tool-calls"].prompts
    with_history = [p for p in tool_prompts if any(m["role"] == "tool" for m in p.messages)]
    assert len(with_history) >= 3
    assert any(len(m["content"]) > 1000 for p in with_history for m in p.messages if m["role"] == "tool")


def test_editing_prompts_quote_a_file_of_40_to_120_lines(sets):
    for p in sets["editing-code"].prompts:
        user = p.messages[-1]["content"]
        body = user.split("```", 2)[1].split("\n", 1)[1]
        assert 40 <= body.count("\n") <= 120, p.id


def test_long_document_prompts_are_long(sets):
    for p in sets["long-document"].prompts:
        assert sum(len(m["content"]) for m in p.messages) > 12_000, p.id
        assert len(p.messages[-1]["content"]) > 12_000, p.id


def test_unknown_set_lists_the_known_names():
    with pytest.raises(UnknownPromptSet) as info:
        ps.load("no-such-set")
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert "no-such-set" in message
    for name in ps.names():
        assert name in message
    assert info.value.known == tuple(ps.names())


# --- validation ---------------------------------------------------------------------------------

def _set(messages, tools=None):
    prompt = {"id": "p1", "messages": messages}
    if tools is not None:
        prompt["tools"] = tools
    return {"name": "mine", "kind": "k", "description": "d", "prompts": [prompt]}


TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}


def _call(cid="call_1", name="read_file", args='{"path": "a"}'):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]}


def test_a_valid_agent_conversation_parses():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, _call(),
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
            {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    s = ps.parse(_set(msgs, [TOOL]))
    assert s.prompts[0].tools == (TOOL,)


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "system", "content": "only a system prompt"}], "no user message"),
    ([{"role": "robot", "content": "hi"}], "invalid role"),
    ([{"role": "user", "content": ""}], "non-empty text"),
    ([{"role": "user", "content": "u"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
     "earlier tool call"),
    ([{"role": "user", "content": "u"}, _call(), {"role": "user", "content": "again"}], "never answered"),
    ([{"role": "user", "content": "u"}, _call(args="not json"), {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
     "arguments"),
    ([{"role": "user", "content": "u"}, _call(name="rm_rf"), {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
     "not in tools"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "end with a user or tool"),
    ([{"role": "user", "content": "u"}, _call(), {"role": "tool", "tool_call_id": "call_1", "content": "x"},
      {"role": "tool", "tool_call_id": "call_1", "content": "again"}], "answered twice"),
])
def test_invalid_prompts_name_the_set_and_prompt(messages, problem):
    with pytest.raises(ValueError) as info:
        ps.parse(_set(messages, [TOOL]), source="mine")
    message = str(info.value)
    assert "'mine'" in message and "'p1'" in message and problem in message


def test_invalid_tools_and_set_fields_are_rejected():
    with pytest.raises(ValueError, match="'p1'.*type 'function'"):
        ps.parse(_set([{"role": "user", "content": "u"}], [{"name": "read_file"}]))
    with pytest.raises(ValueError, match="'kind' must be"):
        ps.parse({"name": "mine", "kind": "", "description": "d", "prompts": []})
    with pytest.raises(ValueError, match="duplicate prompt id"):
        data = _set([{"role": "user", "content": "u"}])
        data["prompts"].append(copy.deepcopy(data["prompts"][0]))
        ps.parse(data)


# --- filler -------------------------------------------------------------------------------------

def test_filler_paragraphs_are_many_and_distinct():
    paragraphs = ps.filler_paragraphs()
    assert len(paragraphs) >= 60
    assert len(set(paragraphs)) == len(paragraphs)
    assert all("\n\n" not in p and p == p.strip() for p in paragraphs)
    words = sum(len(p.split()) for p in paragraphs)
    assert 5_000 <= words <= 7_500


def test_filler_is_deterministic_and_seeded():
    assert ps.filler(5_000, seed=1) == ps.filler(5_000, seed=1)
    assert ps.filler(5_000, seed=1) != ps.filler(5_000, seed=2)
    assert ps.filler(0, seed=1) == ""


@pytest.mark.parametrize("n_chars", [1, 500, 10_000, 100_000])
def test_filler_reaches_n_chars_and_ends_on_a_paragraph_boundary(n_chars):
    paragraphs = set(ps.filler_paragraphs())
    text = ps.filler(n_chars, seed=7)
    assert len(text) >= n_chars
    parts = text.split("\n\n")
    assert all(p in paragraphs for p in parts)          # whole paragraphs only
    assert len(text) - len(parts[-1]) - 2 < n_chars     # stops at the first boundary past n_chars
    assert all(a != b for a, b in zip(parts, parts[1:]))


def test_filler_repeats_reshuffled_beyond_one_pass():
    paragraphs = ps.filler_paragraphs()
    one_pass = sum(len(p) for p in paragraphs) + 2 * (len(paragraphs) - 1)
    parts = ps.filler(one_pass + 5_000, seed=3).split("\n\n")
    first, second = parts[:len(paragraphs)], parts[len(paragraphs):]
    assert sorted(first) == sorted(paragraphs)
    assert second and second != first[:len(second)]


# --- nonce and padding --------------------------------------------------------------------------

def test_with_nonce_copies_and_prefixes_the_first_message(sets):
    messages = list(sets["tool-calls"].prompts[1].messages)
    before = copy.deepcopy(messages)
    a = ps.with_nonce(messages, "n1")
    b = ps.with_nonce(messages, "n2")
    assert messages == before
    assert a[0]["content"] == f"[n1] {messages[0]['content']}"
    assert a[0] != b[0] and a[1:] == b[1:] == before[1:]
    a[2]["tool_calls"][0]["function"]["name"] = "changed"     # a deep copy, not shared dicts
    assert messages == before


def test_pad_to_grows_the_last_user_message_only(sets):
    messages = list(sets["tool-calls"].prompts[1].messages)
    before = copy.deepcopy(messages)
    padded = ps.pad_to(messages, 20_000, seed=5)
    assert messages == before
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    growth = len(padded[last_user]["content"]) - len(messages[last_user]["content"])
    longest = max(len(p) for p in ps.filler_paragraphs())
    assert 20_000 <= growth <= 20_000 + longest + 200
    assert padded[last_user]["content"].startswith("Background material:\n\n")
    assert padded[last_user]["content"].endswith(messages[last_user]["content"])
    assert ps.filler(20_000, seed=5) in padded[last_user]["content"]
    assert [m for i, m in enumerate(padded) if i != last_user] == \
           [m for i, m in enumerate(messages) if i != last_user]
    assert ps.pad_to(messages, 0, seed=5) == messages


def test_padding_then_nonce_still_validates(sets):
    for p in sets["prose"].prompts:
        msgs = ps.with_nonce(ps.pad_to(p.messages, 3_000, seed=1), "abc")
        ps.check_messages(msgs)
