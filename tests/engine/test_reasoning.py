"""Reasoning separation in a format with no calls of its own (chat_formats.Format: the template's
markers, else <think>), whole and streamed in small pieces through the one streaming core."""
from __future__ import annotations

import pytest

from appliance.engine.chat_formats import Context, Format
from appliance.engine.chat_formats.stream import ChatStream
from appliance.engine.reasoning import markers_for


def run(text, step, inside=False, markers=("<think>", "</think>"), extract=True):
    fmt = Format()
    fmt.think = markers
    s = ChatStream(fmt, Context(thinking_open=inside, extract_reasoning=extract))
    pieces = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.flush()]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_leading_block_is_reasoning(step):
    assert run("<think>Let me add 2 and 2.</think>\n\nIt is 4.", step) == ("Let me add 2 and 2.", "It is 4.")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_no_block_is_all_content_as_written(step):
    assert run("Plain answer with a <think> tag in the middle.", step) == \
        ("", "Plain answer with a <think> tag in the middle.")
    assert run("<thin air>", step) == ("", "<thin air>")
    assert run("The sea ", step) == ("", "The sea ")      # trailing space kept: a stop string may cut there


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_template_opened_block(step):
    assert run("weighing options</think>Answer.", step, inside=True) == ("weighing options", "Answer.")
    # cut off while still thinking: everything is reasoning
    assert run("still going </thi", step, inside=True) == ("still going </thi", "")


def test_reasoning_format_none_leaves_it_in_the_content():
    assert run("<think>hm</think>Yes.", 3, extract=False) == ("", "<think>hm</think>Yes.")


def test_streaming_holds_back_only_a_possible_closing_tag():
    fmt = Format()
    s = ChatStream(fmt, Context(thinking_open=True))
    assert s.feed("abc</").reasoning == "abc"
    assert s.feed("x").reasoning == "</x"


def test_prompt_detection():
    fmt = Format()
    assert fmt.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not fmt.prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_markers_are_used_where_the_template_has_them():
    magistral = "{{ '[THINK]' }}...{{ '[/THINK]' }}"
    assert markers_for(magistral) == ("[THINK]", "[/THINK]")
    assert markers_for(None) == ("<think>", "</think>")
    assert run("[THINK]hmm[/THINK]Yes.", 5, markers=markers_for(magistral)) == ("hmm", "Yes.")
