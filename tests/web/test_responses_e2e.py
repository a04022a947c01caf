"""OpenAI's Responses API end to end with the official `openai` SDK against one real server on
the embedded model: create and stream giving the same reply, a forced function call answered
with its output (by items and by previous_response_id), structured output, a stored
conversation continued, retrieved and deleted, and errors in OpenAI's shape."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from .conftest import SHARED

MODEL = "SmolLM2-135M-Instruct-Q4_1"
ASK = "What is the capital of France?"
GREEDY = dict(model="gpt-5-mini", temperature=0)   # any name reaches the one served model


@pytest.fixture(scope="module")
def client(shared_server):
    srv = shared_server(*SHARED)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(client, body, **kw) -> requests.Response:
    """The route without the SDK (bodies it would not send, and what comes before a stream)."""
    return requests.post(f"{client.base_url}responses", json=body, timeout=30, **kw)


def test_create_and_stream_give_the_same_reply(client):
    ask = dict(input=ASK, max_output_tokens=24, instructions="Answer briefly.", **GREEDY)
    whole = client.responses.create(**ask)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.status in ("completed", "incomplete") and whole.output_text.strip()
    assert whole.output[0].type == "message" and whole.output[0].content[0].type == "output_text"
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 24
    with client.responses.stream(**ask) as s:
        streamed = list(s)
    # the SDK's get_final_response() knows only response.completed; a reply cut at
    # max_output_tokens (this model's greedy answer here runs past 24) ends response.incomplete
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    final = streamed[-1].response
    assert streamed[-1].type == f"response.{whole.status}"
    assert text == whole.output_text == final.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    events = list(client.responses.create(stream=True, **ask))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_forced_function_call_answered_by_items_and_by_previous_response_id(client):
    # a bounded argument, as the chat tests have it: the tiny model's strings can run long
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                             "required": ["city"], "additionalProperties": False}}]
    ask = "What is the weather in Paris right now?"
    r = client.responses.create(input=ask, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                                parallel_tool_calls=False, max_output_tokens=120, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str) and calls[0].call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}
    by_items = client.responses.create(input=[{"role": "user", "content": ask}, *[o.to_dict() for o in r.output],
                                              result], tools=tools, max_output_tokens=24, **GREEDY)
    by_id = client.responses.create(previous_response_id=r.id, input=[result], tools=tools, max_output_tokens=24,
                                    **GREEDY)
    # the tiny model may answer a result by calling the tool again: the same answer either way
    assert by_id.previous_response_id == r.id and by_id.output
    assert by_id.usage.input_tokens == by_items.usage.input_tokens and by_id.output_text == by_items.output_text
    shape = lambda resp: [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in resp.output]  # noqa: E731
    assert shape(by_id) == shape(by_items)


def test_text_format_json_schema_gives_json_that_validates(client):
    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}},
              "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(input="Name a colour as JSON.", max_output_tokens=60, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_a_stored_conversation_is_continued_retrieved_and_deleted(client):
    first = client.responses.create(input="My name is Ada.", max_output_tokens=12, **GREEDY)
    follow = dict(input="What is my name?", max_output_tokens=12, **GREEDY)
    continued = client.responses.create(previous_response_id=first.id, **follow)
    spelled_out = client.responses.create(**{**follow, "input": [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}]})
    assert continued.usage.input_tokens == spelled_out.usage.input_tokens > first.usage.total_tokens
    assert continued.output_text == spelled_out.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(input="Hi", max_output_tokens=4, store=False, **GREEDY)
    for gone in (first.id, unstored.id):
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.create(previous_response_id=gone, **follow)
        assert ei.value.body["param"] == "previous_response_id"
        assert ei.value.body["code"] == "previous_response_not_found"


def test_a_prompt_over_the_context_is_a_400_before_any_stream_byte(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(input="x " * 2000, max_output_tokens=8, stream=True, **GREEDY)
    assert ei.value.status_code == 400 and ei.value.body["code"] == "context_length_exceeded"
    r = post(client, {"model": "any", "input": "x " * 2000, "stream": True})
    assert r.status_code == 400 and r.headers["Content-Type"] == "application/json"
    assert r.json()["error"]["n_prompt_tokens"] > r.json()["error"]["n_ctx"]


def test_bad_bodies_are_answered_in_openais_error_shape(client):
    r = post(client, {"model": "any", "input": "hi", "frobnicate": 1})
    assert r.status_code == 400 and r.json() == {"error": {"message": "unknown field(s): frobnicate",
                                                           "type": "invalid_request_error", "param": "frobnicate",
                                                           "code": "invalid_request"}}
    r = post(client, None, data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(input="hi", tools=[{"type": "function", "name": ""}], **GREEDY)
    assert ei.value.body["param"] == "tools[0].name"
    # a hosted tool is left out of the prompt, never a failure: the response lists what was offered
    assert client.responses.create(input="hi", tools=[{"type": "web_search"}], max_output_tokens=3,
                                   **GREEDY).tools == []
    assert client.responses.create(input="Say hi.", max_output_tokens=3, **GREEDY).output_text   # still serving
