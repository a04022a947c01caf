"""docs/api.md's field tables ("Every request field, and what the server does with it") hold
every request field of the SDKs installed, each in one group, and agree with the code: a field
the tables call accepted or built is taken, one they call refused is refused by name. A new SDK
release that adds a field fails here until it is placed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from anthropic.types import message_create_params
from openai.types.responses import response_create_params

from appliance.errors import InvalidRequest
from web import anthropic as A
from web import openai_responses as R

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def tables() -> dict[str, dict[str, set[str]]]:
    """API -> group -> the fields its row names (each row's leading backticked names)."""
    text = DOCS.read_text()
    section = text[text.index("### Every request field"):]
    out: dict[str, dict[str, set[str]]] = {}
    for api in ("OpenAI Responses", "Anthropic Messages", "Ollama"):
        body = section[section.index(api + " (`"):]
        rows = {}
        for group in ("built", "accepted", "refused"):
            line = re.search(rf"^\| {group} \| (.*) \|$", body, re.M).group(1)
            # a field is a backticked name at the row's top level, not inside (...)
            top = re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", line)
            rows[group] = set(re.findall(r"`([a-z_]+)`", top))
        out[api] = rows
    return out


def groups_of(rows: dict[str, set[str]], field: str) -> list[str]:
    return [g for g, names in rows.items() if field in names]


@pytest.mark.parametrize("api,sdk_fields", [
    ("OpenAI Responses", set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}),
    ("Anthropic Messages", set(message_create_params.MessageCreateParamsBase.__annotations__) | {"stream"}),
])
def test_every_sdk_field_is_in_one_group(api, sdk_fields):
    rows = tables()[api]
    misplaced = {f: groups_of(rows, f) for f in sdk_fields if len(groups_of(rows, f)) != 1}
    # context_management is built for its thinking edits and refused for the others
    misplaced.pop("context_management", None) if api == "Anthropic Messages" else None
    assert not misplaced, f"{api}: fields in no group or in several: {misplaced}"


def test_the_responses_table_is_the_codes():
    rows = tables()["OpenAI Responses"]
    assert rows["built"] == R.TRANSLATED
    assert rows["accepted"] == R.ACCEPTED
    assert rows["refused"] == set(R.REFUSED)
    for name in R.REFUSED:
        with pytest.raises(InvalidRequest) as ei:
            R.to_openai({"input": "hi", name: {"id": "x"} if name == "prompt" else True}, "m")
        assert ei.value.param == name


def test_the_anthropic_table_is_the_codes():
    rows = tables()["Anthropic Messages"]
    assert rows["built"] | rows["accepted"] == A.TOP_LEVEL
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for name in rows["accepted"] - {"context_management"}:
        A.to_openai({**body, name: {}}, "m")    # taken
    with pytest.raises(InvalidRequest) as ei:
        A.to_openai({**body, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "m")
    assert ei.value.param == "context_management.edits[0].type"
