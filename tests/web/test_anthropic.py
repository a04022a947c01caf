"""Anthropic's Messages API without a server: the translation to the OpenAI chat request and
the event sequence of a stream (end to end with the SDK: test_apis_e2e.py)."""
from __future__ import annotations

import json

import pytest

from appliance.engine.types import Accepted, Delta, Done, Timings, ToolCall, ToolCallPart, Usage
from appliance.errors import InvalidRequest
from web import anthropic as A


MODEL = "smollm2"


def oai(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 16)
    return A.to_openai(body, MODEL)


def refused(**body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as ei:
        oai(**body)
    assert ei.value.status == 400
    return ei.value


# -- the translation ---------------------------------------------------------------------------
def test_system_blocks_text_and_sampling_become_the_openai_request():
    out = oai(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
              temperature=0.2, top_p=0.9, top_k=40, stop_sequences=["END"], metadata={"user_id": "u1"})
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (out["temperature"], out["top_p"], out["top_k"], out["stop"], out["max_tokens"]) == (0.2, 0.9, 40, ["END"], 16)
    assert out["stream"] is False and "stream_options" not in out
    assert oai(stream=True)["stream_options"] == {"include_usage": True}


def test_tool_use_and_tool_results_round_trip_as_openai_tool_messages():
    out = oai(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "tu_1", "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "21C"}]},
                                     {"type": "tool_result", "tool_use_id": "tu_2", "content": "down", "is_error": True},
                                     {"type": "text", "text": "And tomorrow?"}]}],
        tools=[{"name": "weather", "description": "the weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert out["messages"][1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "tu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
        "reasoning_content": "hmm"}     # earlier thinking, for templates that keep it
    assert out["messages"][2:] == [{"role": "tool", "tool_call_id": "tu_1", "content": "21C"},
                                   {"role": "tool", "tool_call_id": "tu_2", "content": "Error: down"},
                                   {"role": "user", "content": "And tomorrow?"}]
    assert out["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                              "description": "the weather"}}]
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False


def test_an_empty_messages_list_renders_the_system_prompt_alone():
    """As llama-server does (its convert_anthropic_to_oai): the template gets what there is."""
    assert oai(system="Be brief.", messages=[])["messages"] == [{"role": "system", "content": "Be brief."}]
    assert refused(messages=[]).param == "messages"       # and without a system prompt, nothing to answer


PNG = "iVBORw0KGgo="


def test_a_tool_results_images_stay_in_its_tool_message():
    """A screenshot tool's result: its text and pictures in order, as OpenAI's parts (wire.py
    reads them as a user turn's, so a model without images refuses them the same way)."""
    result = {"type": "tool_result", "tool_use_id": "tu_1", "content": [
        {"type": "text", "text": "the page:"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}
    tool = oai(messages=[{"role": "user", "content": [result]}])["messages"][0]
    assert tool == {"role": "tool", "tool_call_id": "tu_1", "content": [
        {"type": "text", "text": "the page:"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}
    failed = oai(messages=[{"role": "user", "content": [{**result, "is_error": True}]}])["messages"][0]
    assert failed["content"][0] == {"type": "text", "text": "Error: "} and len(failed["content"]) == 3


def test_earlier_thinking_is_the_assistants_reasoning_and_clear_thinking_keeps_the_last():
    turn = [{"role": "user", "content": "go"}]
    for n in (1, 2, 3):
        turn += [{"role": "assistant", "content": [{"type": "thinking", "thinking": f"t{n}", "signature": ""},
                                                   {"type": "text", "text": f"a{n}"}]},
                 {"role": "user", "content": "more"}]

    def kept(**body):
        return [m.get("reasoning_content") for m in oai(messages=turn, **body)["messages"] if m["role"] == "assistant"]

    assert kept() == ["t1", "t2", "t3"]                  # all of it: the template keeps what it keeps
    edit = {"type": "clear_thinking_20251015"}
    assert kept(context_management={"edits": [edit]}) == [None, None, "t3"]     # Anthropic's default: 1
    assert kept(context_management={"edits": [{**edit, "keep": {"type": "thinking_turns", "value": 2}}]}) == \
        [None, "t2", "t3"]
    assert kept(context_management={"edits": [{**edit, "keep": "all"}]}) == ["t1", "t2", "t3"]


@pytest.mark.parametrize("choice,expected", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                             ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}})])
def test_tool_choice(choice, expected):
    assert oai(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice=choice)["tool_choice"] == expected


def test_output_config_format_is_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = oai(output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_claude_codes_attribution_block_is_left_out_of_the_prompt():
    """Its hash changes with every request: left in, it would be the prompt's first tokens and
    no turn would reuse the cached prefix of the last (issue 69)."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.fd9; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": "You are a Claude agent."}]
    assert oai(system=system)["messages"][0] == {"role": "system", "content": "You are a Claude agent."}
    assert oai(system="x-anthropic-billing-header: a;\nrest")["messages"][0]["content"] == "rest"


def test_claude_codes_request_a_system_message_in_messages_effort_and_server_tools():
    """What Claude Code sends: a system message after the first user turn, adaptive thinking with
    an effort, a thinking-clearing context_management edit, and (for others) Anthropic's server
    tools, which are left out of the prompt."""
    out = oai(system="You are an agent.", thinking={"type": "adaptive"}, output_config={"effort": "high"},
              context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
              metadata={"user_id": "{}"},
              messages=[{"role": "user", "content": "run it"}, {"role": "system", "content": [
                  {"type": "text", "text": "Agent types: claude."}]}],
              tools=[{"name": "Bash", "input_schema": {"type": "object"}},
                     {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}])
    assert out["messages"] == [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "run it"},
                               {"role": "system", "content": "Agent types: claude."}]
    assert out["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "high"}
    assert [t["function"]["name"] for t in out["tools"]] == ["Bash"]
    assert oai(thinking={"type": "disabled"}, output_config={"effort": "low"})["chat_template_kwargs"] == \
        {"enable_thinking": False, "reasoning_effort": "low"}
    assert oai(output_config={"effort": "max"})["chat_template_kwargs"] == {"enable_thinking": True}


def test_thinking_maps_to_the_templates_switch():
    assert oai(thinking={"type": "enabled", "budget_tokens": 1024})["chat_template_kwargs"] == {"enable_thinking": True}
    assert oai(thinking={"type": "disabled"})["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in oai()


@pytest.mark.parametrize("body,param", [
    (dict(max_tokens=None), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(messages=[]), "messages"), (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].source"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "messages[0].content[0].tool_use_id"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]), "messages[0].content[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "file"}}]}]}]), "messages[0].content[0].content[0].source"),
    (dict(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": 1}]}),
     "context_management.edits[0].keep"),
    (dict(stop_sequences="END"), "stop_sequences"), (dict(tool_choice={"type": "some"}), "tool_choice"),
    (dict(tools=[{"name": "f"}]), "tools[0]"), (dict(thinking={"type": "on"}), "thinking"),
    (dict(logit_bias={}), "logit_bias"),
        (dict(output_config={"effort": "huge"}), "output_config.effort"), (dict(output_config="high"), "output_config"),
        (dict(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}), "context_management.edits[0].type"),
        (dict(context_management={"edits": "all"}), "context_management"), (dict(stream="yes"), "stream"), (dict(metadata="x"), "metadata"),
])
def test_bad_requests_are_refused_by_name(body, param):
    assert refused(**body).param == param


# -- the stream's event sequence ---------------------------------------------------------------
def events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.decode().strip().split("\n\n"):
        kind, payload = block.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def test_blocks_are_opened_and_closed_in_order_with_their_indices():
    class Sub:   # what EventWriter reads of a submitted request
        accepted = Accepted("chatcmpl-1", 12, 4)

        class parsed:
            class request:
                id = "chatcmpl-abc"

    w = A.EventWriter(Sub, "m")
    timings = Timings(8, 4, 10.0, 5, 20.0, 0.0, 256)
    raw = w.start() + w.delta(Delta("r", "", (1,), reasoning="Let me think")) + w.delta(Delta("r", "Hi", (2,))) \
        + w.delta(Delta("r", " there", (3,))) + w.delta(Delta("r", "", (4,), tool_calls=(ToolCall("tu_1", "f", '{"a":1}'),),
                                                                call_parts=(ToolCallPart(0, "tu_1", "f"), ToolCallPart(0, arguments='{"a":1}')))) \
        + w.end(Done("r", "tool_calls", Usage(12, 5, 4), timings))
    ev = events(raw)
    assert [k for k, _ in ev] == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                                  "content_block_stop", "content_block_start", "content_block_delta",
                                  "content_block_delta", "content_block_stop", "content_block_start",
                                  "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert ev[0][1]["message"]["usage"]["input_tokens"] == 12 and ev[0][1]["message"]["id"] == "msg_abc"
    starts = [d for k, d in ev if k == "content_block_start"]
    assert [(d["index"], d["content_block"]["type"]) for d in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    deltas = [d["delta"]["type"] for k, d in ev if k == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "text_delta", "input_json_delta"]
    assert ev[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ev[-2][1]["usage"]["output_tokens"] == 5
