"""The checks a family's tests run on every recorded case of its templates (llama_chat.json):
whole replies equal llama.cpp's message, partial ones a prefix of it, streamed replies equal the
whole, and replies llama.cpp fails on keep their text."""
from __future__ import annotations

import re
from typing import Any, Iterable

import pytest

from appliance.engine.chat_formats import Format, detect

from ..chat_templates import cases as templates
from .reference import chunkings, context, expected, kept_what_llama_cpp_dropped, message, reference, streamed

# llama.cpp parses a continued message's prefill (in its generation prompt) with the reply; the
# appliance's parse sees the reply alone, so these cases cannot come out the same
CONTINUED = "a continued message: llama.cpp parses the prefilled text with the reply"


def params(names: Iterable[str], known: dict[str, str] | None = None) -> list[Any]:
    """pytest params (template, case) for every case of `names`; a case is skipped where it is a
    continuation or `known` (case name -> why) says it differs."""
    ref, out = reference(), []
    for t in names:
        for i, case in enumerate((ref.get(t) or {}).get("cases", [])):
            req = case["request"]
            why = (CONTINUED if req.get("continue_final_message") or req.get("add_generation_prompt") is False
                   else (known or {}).get(case["name"]))
            marks = [pytest.mark.skip(reason=why)] if why else []
            out.append(pytest.param(t, case, id=f"{t}-{i}-{case['name']}", marks=marks))
    return out


def fmt_ctx(template: str, case: dict):
    fmt: Format = detect(templates.template(template))
    return fmt, context(fmt, case["request"], case.get("generation_prompt", ""))


def check_whole(template: str, case: dict) -> None:
    fmt, ctx = fmt_ctx(template, case)
    got = message(fmt, ctx, case["reply"])
    if "error" in case:     # llama.cpp throws: no text is lost, the reply's text stays in the message
        kept = got["content"] + got["reasoning_content"] + "".join(str(c["arguments"]) for c in got["tool_calls"])
        assert kept.strip() or not case["reply"].strip()
    elif case["partial"]:
        _prefix(fmt.parse(case["reply"], ctx, partial=True), case["message"])
    else:
        want = expected(case["message"])
        assert got == want or kept_what_llama_cpp_dropped(got, want, case["reply"])


def check_streamed(template: str, case: dict) -> None:
    fmt, ctx = fmt_ctx(template, case)
    whole = message(fmt, ctx, case["reply"])
    for sizes in chunkings():
        assert streamed(fmt, ctx, case["reply"], sizes) == whole


def _prefix(got, msg: dict) -> None:
    """A partial parse: ours holds back at least as much as llama.cpp's (whitespace aside)."""
    assert (msg.get("content") or "").startswith(got.content)
    assert (msg.get("reasoning_content") or "").startswith(got.reasoning)
    theirs = msg.get("tool_calls") or []
    assert [c.name for c in got.calls] == [c["name"] for c in theirs][:len(got.calls)]
    for ours, their in zip(got.calls, theirs):
        assert _squeeze(their["arguments"]).startswith(_squeeze(ours.arguments))


def _squeeze(s: str) -> str:
    return re.sub(r"\s+", "", s)
