"""Reasoning separation, whole and streamed in small pieces."""
from __future__ import annotations

import pytest

from appliance.engine.reasoning import ReasoningParser, prompt_opens_thinking


def run(text, step, inside=False):
    p = ReasoningParser(inside)
    reasoning = content = ""
    for i in range(0, len(text), step):
        s = p.feed(text[i:i + step])
        reasoning += s.reasoning
        content += s.content
    s = p.flush()
    return reasoning + s.reasoning, content + s.content


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_leading_block_is_reasoning(step):
    assert run("<think>Let me add 2 and 2.</think>\n\nIt is 4.", step) == ("Let me add 2 and 2.", "It is 4.")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_no_block_is_all_content(step):
    assert run("Plain answer with a <think> tag in the middle.", step) == \
        ("", "Plain answer with a <think> tag in the middle.")
    assert run("<thin air>", step) == ("", "<thin air>")


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_template_opened_block(step):
    assert run("weighing options</think>Answer.", step, inside=True) == ("weighing options", "Answer.")
    # cut off while still thinking: everything is reasoning
    assert run("still going </thi", step, inside=True) == ("still going </thi", "")


def test_streaming_holds_back_only_a_possible_closing_tag():
    p = ReasoningParser(inside=True)
    assert p.feed("abc</").reasoning == "abc"
    assert p.feed("x").reasoning == "</x"


def test_prompt_detection():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_markers_are_used_where_the_template_has_them():
    from appliance.engine.reasoning import markers_for

    magistral = "{{ '[THINK]' }}...{{ '[/THINK]' }}"
    assert markers_for(magistral) == ("[THINK]", "[/THINK]")
    assert markers_for(None) == ("<think>", "</think>")
    p = ReasoningParser(markers=("[THINK]", "[/THINK]"))
    a, b = p.feed("[THINK]hmm[/THI"), p.feed("NK]Yes.")
    assert (a.reasoning + b.reasoning, a.content + b.content) == ("hmm", "Yes.")
    assert prompt_opens_thinking("x [THINK]", "[THINK]")
