"""Anthropic's Messages API through the whole app, with the `anthropic` SDK over a socket, on
scripted models carrying real templates (tests/web/scripted_engine.py records each prompt as the
template rendered it): an empty `messages` list renders the system prompt alone, as llama-server
does, or is the template's own 400; earlier thinking reaches a template that keeps it; and
count_tokens counts exactly what /v1/messages prefills."""
from __future__ import annotations

import base64

import anthropic
import pytest

from tests.engine.mmproj_fixture import picture

from .scripted_engine import ScriptedEngine, app_for, model, serve

THOUGHT = "The user wants the weather: call the tool."
TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                      {"type": "tool_use", "id": "tu_1", "name": "weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "21C"}]}]
TOOLS = [{"name": "weather", "description": "the weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("anthropic-app"))


@pytest.fixture
def served(tmp, request):
    """(the SDK's client, the scripted engine) for the template the test is parametrized with."""
    engine = ScriptedEngine(model(request.param, tmp))
    engine.reply = "Sunny."
    with serve(app_for(engine, tmp, request.param)) as url:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0), engine


def counted(client, **body) -> int:
    return client.messages.count_tokens(model="m", **body).input_tokens


@pytest.mark.parametrize("served", ["Qwen-Qwen3-0.6B"], indirect=True)
def test_no_messages_renders_the_system_prompt_alone(served):
    client, engine = served
    out = client.messages.create(model="m", max_tokens=8, system="Be brief.", messages=[])
    assert out.content[0].text == "Sunny."
    assert engine.prompts_seen[-1] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
    assert counted(client, system="Be brief.", messages=[]) == out.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as ei:        # no system either: nothing to answer
        client.messages.create(model="m", max_tokens=8, messages=[])
    assert "nothing to answer" in ei.value.body["error"]["message"]


@pytest.mark.parametrize("served", ["Qwen3.5-4B"], indirect=True)
def test_a_template_that_needs_a_user_turn_says_so(served):
    client, _ = served
    for call in (lambda: client.messages.create(model="m", max_tokens=8, system="Be brief.", messages=[]),
                 lambda: counted(client, system="Be brief.", messages=[])):
        with pytest.raises(anthropic.BadRequestError) as ei:
            call()
        assert "No user query found" in ei.value.body["error"]["message"]


@pytest.mark.parametrize("served", ["Qwen-Qwen3-0.6B"], indirect=True)
def test_earlier_thinking_reaches_a_template_that_keeps_it_and_is_counted(served):
    """Qwen3 keeps the thinking of the turns since the last user query (a tool loop's)."""
    client, engine = served
    out = client.messages.create(model="m", max_tokens=8, messages=TURNS, tools=TOOLS)
    assert f"<think>\n{THOUGHT}\n</think>" in engine.prompts_seen[-1]
    assert counted(client, messages=TURNS, tools=TOOLS) == out.usage.input_tokens
    cleared = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}
    less = client.messages.create(model="m", max_tokens=8, messages=TURNS, tools=TOOLS,
                                  extra_body={"context_management": cleared})
    assert THOUGHT not in engine.prompts_seen[-1] and less.usage.input_tokens < out.usage.input_tokens
    assert counted(client, messages=TURNS, tools=TOOLS, extra_body={"context_management": cleared}) == \
        less.usage.input_tokens


@pytest.mark.parametrize("served", ["Qwen-Qwen3-0.6B"], indirect=True)
def test_a_tool_results_picture_is_refused_by_a_model_that_takes_none_as_a_user_turns(served):
    client, _ = served
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture(seed=1)).decode()}}
    shot = [*TURNS[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                                      "content": [{"type": "text", "text": "the page:"}, image]}]}]
    for messages in (shot, [{"role": "user", "content": [image]}]):
        with pytest.raises(anthropic.BadRequestError) as ei:
            client.messages.create(model="m", max_tokens=8, messages=messages, tools=TOOLS)
        assert "does not take images" in ei.value.body["error"]["message"]
