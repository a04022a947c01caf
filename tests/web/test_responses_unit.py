"""OpenAI's Responses API without a server: the translation to the OpenAI chat request, the
store behind previous_response_id, and the output items and event sequence (checked against the
`openai` SDK's own types; end to end with the SDK: test_responses_e2e.py)."""
from __future__ import annotations

import json

import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from appliance.engine.types import Delta, Done, Timings, ToolCall, ToolCallPart, Usage
from appliance.errors import EngineCrashed, InvalidRequest
from web import openai_responses as R
from web import openai_responses_tools as tools
from web.openai_responses_writer import ResponseWriter, SseWriter, new_response, sse
from web.wire import parse_chat

MODEL = "smollm2"
TOOL = {"type": "function", "name": "weather", "description": "the weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def oai(earlier=(), **body):
    body.setdefault("input", "hi")
    return R.to_openai(body, MODEL, earlier)


# -- the translation ---------------------------------------------------------------------------
def test_a_string_input_with_instructions_and_sampling_becomes_the_chat_request():
    out = oai(input="Hello", instructions="Be brief.", temperature=0.2, top_p=0.9, max_output_tokens=16,
              seed=7, user="u1", metadata={"k": "v"}, store=False, truncation="disabled", include=[],
              service_tier="auto", prompt_cache_key="c", safety_identifier="s")
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (out["temperature"], out["top_p"], out["max_tokens"], out["seed"]) == (0.2, 0.9, 16, 7)
    assert out["stream"] is False and out["add_generation_prompt"] is True
    assert not {"user", "metadata", "store", "instructions", "input"} & set(out)


def test_items_become_messages_calls_join_the_assistant_turn_and_outputs_answer_them():
    out = oai(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25C"}]}])
    assert out["messages"] == [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25C"}]
    parsed = parse_chat(out, "chatcmpl-1", {MODEL}, 2048).request    # what the chat validation makes of it
    assert [m.role for m in parsed.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c.id for c in parsed.messages[2].tool_calls] == ["call_1", "call_2"]
    assert parsed.add_generation_prompt and not parsed.continue_final


def test_a_call_without_a_message_before_it_opens_an_assistant_turn():
    out = oai(input=[{"role": "user", "content": "hi"},
                     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert out["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_earlier_turns_go_between_the_instructions_and_the_new_input():
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    out = oai(earlier, input="And now?", instructions="Be kind.")
    assert [m["content"] for m in out["messages"]] == ["Be kind.", "Hi", "Hello!", "And now?"]


def test_function_tools_and_tool_choice():
    out = oai(tools=[TOOL], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)
    assert out["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "the weather", "parameters": TOOL["parameters"], "strict": True}}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert out["parallel_tool_calls"] is False
    for choice in ("auto", "none", "required"):
        assert oai(tools=[TOOL], tool_choice=choice)["tool_choice"] == choice
    assert parse_chat(out, "chatcmpl-1", {MODEL}, 2048).request.tool_choice == "weather"


CODEX_NS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
            "tools": [{"type": "function", "name": "close_agent", "description": "Close one.", "strict": False,
                       "parameters": {"type": "object", "properties": {"target": {"type": "string"}}}}]}


def test_namespace_tools_are_offered_under_flat_names_and_hosted_tools_are_left_out():
    """Codex's request: functions, a namespace of functions, and web_search, which this server
    cannot run: left out of the prompt, never a failure."""
    body = {"input": "hi", "tools": [TOOL, CODEX_NS, {"type": "web_search", "external_web_access": False}],
            "tool_choice": {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
            "client_metadata": {"x-codex-turn-metadata": "{}"}, "prompt_cache_key": "s", "store": False,
            "include": ["reasoning.encrypted_content"]}
    offered = tools.offered(body)
    out = R.to_openai(body, MODEL, (), offered)
    assert [t["function"]["name"] for t in out["tools"]] == ["weather", "multi_agent_v1__close_agent"]
    assert out["tools"][1]["function"]["description"] == "Sub-agents.\nClose one."
    assert out["tool_choice"] == {"type": "function", "function": {"name": "multi_agent_v1__close_agent"}}
    assert offered.left_out == ["web_search"] and offered.echo == [TOOL, CODEX_NS]
    assert offered.call_name("multi_agent_v1__close_agent") == {"type": "function_call", "name": "close_agent",
                                                                "namespace": "multi_agent_v1"}
    assert offered.call_name("weather") == {"type": "function_call", "name": "weather"}
    # an earlier turn's call in the namespace goes back under the flat name
    items = [{"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1",
              "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "closed"}]
    assert R.messages(items, "input")[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"


PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}


def test_a_custom_tool_is_a_function_of_one_string_and_its_call_a_custom_tool_call():
    """Codex's apply_patch for the models it knows (gpt-5.5): offered as a function of `input`,
    the grammar written for the model; the call comes back as a custom_tool_call item, whole
    and streamed, and goes back into the prompt as that function's call."""
    offered = tools.offered({"tools": [PATCH]})
    fn = offered.tools[0]["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert fn["description"].startswith("Edit files.") and "start: begin_patch hunk+ end_patch" in fn["description"]
    w = ResponseWriter(new_response({"input": "hi"}, "resp_abc", "m"), "abc", offered.call_name)
    patch = "*** Begin Patch\n*** End Patch"
    events = run(w, [Delta("r", "", (1,), call_parts=(ToolCallPart(0, "call_1", "apply_patch"),
                                                      ToolCallPart(0, arguments=json.dumps({"input": patch}))))],
                 Done("r", "tool_calls", Usage(5, 2), TIMINGS))
    item = w.response["output"][0]
    assert (item["type"], item["name"], item["input"], item["call_id"]) == ("custom_tool_call", "apply_patch", patch, "call_1")
    for ev in events:
        EVENT.validate_python(ev)
    assert [e["type"] for e in events if "custom" in e["type"]] == ["response.custom_tool_call_input.delta",
                                                                    "response.custom_tool_call_input.done"]
    SdkResponse.model_validate(w.response)
    history = R.messages([item, {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"}], "input")
    assert history[0]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": json.dumps({"input": patch})}
    assert history[1] == {"role": "tool", "tool_call_id": "call_1", "content": "Done!"}


def test_a_call_in_a_namespace_comes_back_with_its_name_and_namespace():
    offered = tools.offered({"tools": [CODEX_NS]})
    w = ResponseWriter(new_response({"input": "hi"}, "resp_abc", "m"), "abc", offered.call_name)
    events = run(w, [Delta("r", "", (1,), call_parts=(ToolCallPart(0, "call_1", "multi_agent_v1__close_agent"),
                                                      ToolCallPart(0, arguments="{}")))], Done("r", "tool_calls", Usage(5, 2), TIMINGS))
    item = w.response["output"][0]
    assert (item["name"], item["namespace"], item["arguments"]) == ("close_agent", "multi_agent_v1", "{}")
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["namespace"] == "multi_agent_v1"
    SdkResponse.model_validate(w.response)


def test_text_format_is_the_chat_requests_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = oai(text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True},
                    "verbosity": "low"})
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                             "strict": True}}
    assert parse_chat(out, "chatcmpl-1", {MODEL}, 2048).request.constraint.kind == "json_schema"
    assert oai(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in oai(text={"format": {"type": "text"}})


@pytest.mark.parametrize("effort,kwargs", [
    ("none", {"enable_thinking": False}), ("minimal", {"enable_thinking": False}),
    ("low", {"enable_thinking": True, "reasoning_effort": "low"}),
    ("high", {"enable_thinking": True, "reasoning_effort": "high"}), ("xhigh", {"enable_thinking": True})])
def test_reasoning_effort_is_the_templates_thinking_switch(effort, kwargs):
    assert oai(reasoning={"effort": effort, "summary": "auto"})["chat_template_kwargs"] == kwargs


def test_no_effort_leaves_the_templates_default():
    assert "chat_template_kwargs" not in oai(reasoning={"summary": "auto"})
    assert "chat_template_kwargs" not in oai()


@pytest.mark.parametrize("body,param", [
    (dict(input=None), "input"), (dict(input=[]), "input"), (dict(input=5), "input"),
    (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
    (dict(input=[{"role": "user", "content": 5}]), "input[0].content"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]),
     "input[0].content[0].image_url"),
    (dict(input=[{"type": "function_call", "name": "f"}]), "input[0]"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(input=["hi"]), "input[0]"),
    (dict(tools=[{"type": "computer_use"}]), "tools[0].type"), (dict(tools={}), "tools"),
    (dict(tools=[{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "ebnf"}}]),
     "tools[0].format"),
    (dict(tools=[{"type": "namespace", "name": "ns", "tools": [{"type": "mcp", "name": "f"}]}]),
     "tools[0].tools[0].type"),
    (dict(tools=[{"type": "namespace", "name": "a__b", "tools": []}]), "tools[0].name"),
    (dict(tools=[TOOL, {**TOOL}]), "tools"),
    (dict(tools=[{"type": "function"}]), "tools[0].name"),
    (dict(tool_choice="any"), "tool_choice"), (dict(tool_choice={"type": "function"}), "tool_choice.name"),
    (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(text={"colour": "red"}), "text.colour"), (dict(text="json"), "text"),
    (dict(reasoning={"effort": "extreme"}), "reasoning.effort"), (dict(reasoning="high"), "reasoning"),
    (dict(max_output_tokens=0), "max_output_tokens"), (dict(max_output_tokens=True), "max_output_tokens"),
    (dict(stream="yes"), "stream"), (dict(store="no"), "store"), (dict(metadata="x"), "metadata"),
    (dict(instructions=["x"]), "instructions"), (dict(truncation="middle"), "truncation"),
    (dict(background=True), "background"), (dict(conversation="conv_1"), "conversation"),
    (dict(prompt={"id": "pmpt_1"}), "prompt"), (dict(top_logprobs=3), "top_logprobs"),
    (dict(messages=[]), "messages"), (dict(max_tokens=5, frobnicate=1), "frobnicate"),
])
def test_bad_requests_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequest) as ei:
        oai(**body)
    assert ei.value.status == 400 and ei.value.param == param
    assert param.split("[")[0].split(".")[0] in ei.value.message


# -- the store ---------------------------------------------------------------------------------
def test_the_store_keeps_the_last_n_and_a_read_keeps_one_longer():
    store = R.ResponseStore(size=2)
    for rid in ("a", "b"):
        store.put(rid, R.Stored([{"role": "user", "content": rid}], {"id": rid}))
    assert store.get("a") is not None          # read: now the most recently used
    store.put("c", R.Stored([], {"id": "c"}))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


def test_previous_response_id_gives_the_stored_conversation_or_a_400():
    store = R.ResponseStore()
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    store.put("resp_1", R.Stored(conversation, {"id": "resp_1"}))
    assert R.history(store, {"previous_response_id": "resp_1"}) == conversation
    assert R.history(store, {}) == []
    with pytest.raises(InvalidRequest) as ei:
        R.history(store, {"previous_response_id": "resp_gone"})
    assert ei.value.param == "previous_response_id" and "resp_gone" in ei.value.message
    assert ei.value.body()["error"]["code"] == "previous_response_not_found"
    with pytest.raises(InvalidRequest) as ei:
        R.history(store, {"previous_response_id": 5})
    assert ei.value.param == "previous_response_id"


def test_output_items_continue_as_chat_messages():
    output = [{"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
              {"type": "message", "id": "m", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
              {"type": "function_call", "id": "fc", "call_id": "call_9", "name": "f", "arguments": "{}",
               "status": "completed"}]
    assert R.messages(output, "output") == [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


# -- the output and the stream -----------------------------------------------------------------
TIMINGS = Timings(8, 4, 10.0, 5, 20.0, 0.0, 256)
EVENT = TypeAdapter(ResponseStreamEvent)


def writer(**body) -> ResponseWriter:
    body.setdefault("input", "hi")
    return ResponseWriter(new_response(body, "resp_abc", "m"), "abc")


def run(w: ResponseWriter, deltas, done) -> list[dict]:
    events = w.start()
    for d in deltas:
        events += w.delta(d)
    return events + w.end(done)


THINK_TALK_CALL = [Delta("r", "", (1,), reasoning="Let me "), Delta("r", "", (2,), reasoning="think"),
                   Delta("r", "Hi", (3,)), Delta("r", " there", (4,)),
                   Delta("r", "", (5,), call_parts=(ToolCallPart(0, "call_1", "weather"), ToolCallPart(0, arguments='{"city":'))),
                   Delta("r", "", (6,), tool_calls=(ToolCall("call_1", "weather", '{"city":"Paris"}'),),
                         call_parts=(ToolCallPart(0, arguments='"Paris"}'),))]


def test_events_come_in_order_numbered_and_as_the_sdk_types_them():
    events = run(writer(tools=[TOOL]), THINK_TALK_CALL, Done("r", "tool_calls", Usage(12, 6, 4), TIMINGS))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)
    added = [(e["output_index"], e["item"]["type"], e["item"]["status"]) for e in events
             if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning", "in_progress"), (1, "message", "in_progress"), (2, "function_call", "in_progress")]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == "Hi there" and text_done["item_id"] == "msg_abc_1"


def test_the_final_response_holds_the_items_the_stream_finished():
    events = run(writer(tools=[TOOL]), THINK_TALK_CALL, Done("r", "tool_calls", Usage(12, 6, 4), TIMINGS))
    final = events[-1]["response"]
    SdkResponse.model_validate(final)
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think"}] and reasoning["summary"] == []
    assert message["content"] == [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == \
        ("call_1", "weather", '{"city":"Paris"}', "completed")
    assert final["status"] == "completed" and final["incomplete_details"] is None and final["id"] == "resp_abc"
    assert final["usage"] == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 2},
                              "total_tokens": 18}
    assert final["tools"] == [TOOL] and final["model"] == "m" and final["timings"]["predicted_n"] == 5


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    events = run(writer(max_output_tokens=2), [Delta("r", "Hi", (1,)), Delta("r", " the", (2,))],
                 Done("r", "length", Usage(5, 2), TIMINGS))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete" and final["response"]["completed_at"] is None
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete" and final["response"]["max_output_tokens"] == 2
    SdkResponse.model_validate(final["response"])


def test_an_error_after_the_status_line_is_an_error_event_then_a_failed_response():
    w = writer()
    events = w.start() + w.delta(Delta("r", "Hi", (1,))) + w.error(EngineCrashed("the engine stopped"))
    error, failed = events[-2:]
    assert (error["type"], error["code"], error["message"]) == ("error", "engine_crashed", "the engine stopped")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the engine stopped"}
    for e in events:
        EVENT.validate_python(e)


def test_server_sent_events_name_their_type_and_the_stream_hands_over_the_final_response():
    kept = []
    s = SseWriter(writer(), kept.append)
    raw = s.start() + s.delta(Delta("r", "Hi", (1,))) + s.end(Done("r", "stop", Usage(5, 1), TIMINGS))
    blocks = raw.decode().strip().split("\n\n")
    for block in blocks:
        kind, data = block.split("\n")
        assert kind.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert kept and kept[0]["status"] == "completed" and kept[0]["output"][0]["content"][0]["text"] == "Hi"
    assert s.idle().startswith(b":") and sse([]) == b""
