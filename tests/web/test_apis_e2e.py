"""The other APIs end to end, each with its official client against one real server on the
embedded model: Anthropic's Messages (`anthropic` SDK: messages, streaming, stop sequences,
tools, count_tokens, errors) and Ollama's (`ollama` client: chat streamed and not, generate,
tags, show, ps, version, format, errors). And what every API's chat route does with a body no
client should send: a 4xx in that API's shape, over real HTTP, and the next request answered."""
from __future__ import annotations

import json

import pytest
import requests

from .conftest import SHARED

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*SHARED)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}   # the API takes it; this SDK no longer has the argument


def test_anthropic_create_answers_with_the_served_model_whatever_name_the_client_sends(client):
    msg = client.messages.create(model="a-model-this-server-does-not-have", max_tokens=24, extra_body=GREEDY, messages=ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "SmolLM2-135M-Instruct-Q4_1"
    assert msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 24
    assert msg.usage.input_tokens > 5


def test_anthropic_stream_gives_the_same_message_as_create(client):
    whole = client.messages.create(model="any", max_tokens=24, extra_body=GREEDY, messages=ASK)
    with client.messages.stream(model="any", max_tokens=24, extra_body=GREEDY, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_a_stop_sequence_is_reported_as_such(client):
    whole = client.messages.create(model="any", max_tokens=24, extra_body=GREEDY, messages=ASK).content[0].text
    word = whole.split()[2]
    msg = client.messages.create(model="any", max_tokens=24, extra_body=GREEDY, messages=ASK, stop_sequences=[word, "zzzz"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert word not in msg.content[0].text and whole.startswith(msg.content[0].text)


def test_anthropic_count_tokens_is_what_create_is_charged(client):
    body = dict(system="Answer briefly.", messages=ASK,
                tools=[{"name": "weather", "description": "weather for a city",
                        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}])
    counted = client.messages.count_tokens(model="any", **body).input_tokens
    used = client.messages.create(model="any", max_tokens=4, extra_body=GREEDY, **body).usage.input_tokens
    assert counted == used > 20


def test_anthropic_forced_tool_use_and_its_result(client):
    # a bounded argument, as the OpenAI tests have it: the tiny model's strings can run long
    tools = [{"name": "weather", "description": "Get the weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                               "required": ["city"], "additionalProperties": False}}]
    msg = client.messages.create(model="any", max_tokens=120, extra_body=GREEDY, tools=tools,
                                 tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    use = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(use) >= 1
    assert use[0].name == "weather" and isinstance(use[0].input.get("city"), str)
    reply = client.messages.create(model="any", max_tokens=24, extra_body=GREEDY, tools=tools, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "21 C and sunny"}]}])
    # the tiny model answers a result by calling the tool again (a complete call, cut off before
    # its closing tag by max_tokens): any block is an answer here
    assert reply.content and reply.content[0].type in ("text", "tool_use")


def test_anthropic_errors_come_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="any", max_tokens=24, messages=[{"role": "user", "content": "x " * 2000}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    r = requests.post(server.url + "/v1/messages", json={"model": "any", "messages": ASK}, timeout=10)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required: a positive integer"}}
    r = requests.post(server.url + "/v1/messages", data=b"{not json", headers={"Content-Type": "application/json"},
                      timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # a prompt over the context is refused before any stream byte
    r = requests.post(server.url + "/v1/messages", json={"model": "any", "max_tokens": 8, "stream": True,
                                                         "messages": [{"role": "user", "content": "x " * 2000}]},
                      timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


# -- Ollama's API, with the ollama client ------------------------------------------------------
@pytest.fixture(scope="module")
def ol(server):
    return ollama.Client(host=server.url, timeout=120)


def test_ollama_tags_show_ps_and_version(ol, server):
    tags = ol.list()
    assert [m.model for m in tags.models] == ["SmolLM2-135M-Instruct-Q4_1"]
    m = tags.models[0]
    assert m.size > 50_000_000 and m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1"
    shown = ol.show("SmolLM2-135M-Instruct-Q4_1")
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    assert [p.model for p in ol.ps().models] == ["SmolLM2-135M-Instruct-Q4_1"]
    assert requests.get(server.url + "/api/version", timeout=5).json()["version"]


def test_ollama_chat_streamed_equals_not_streamed(ol):
    ask = dict(model="SmolLM2-135M-Instruct-Q4_1:latest", messages=ASK, options={"temperature": 0, "num_predict": 24})
    whole = ol.chat(**ask)
    parts = list(ol.chat(stream=True, **ask))
    assert "".join(p.message.content for p in parts) == whole.message.content and whole.message.content.strip()
    last = parts[-1]
    assert last.done and last.done_reason == whole.done_reason and last.eval_count == whole.eval_count <= 24
    assert whole.prompt_eval_count > 5 and whole.eval_duration > 0 and whole.total_duration >= whole.eval_duration


def test_ollama_generate_and_a_json_format(ol):
    r = ol.generate(model="SmolLM2-135M-Instruct-Q4_1", prompt="Name a colour.", options={"temperature": 0, "num_predict": 16})
    assert r.response.strip() and r.done
    raw = ol.generate(model="SmolLM2-135M-Instruct-Q4_1", prompt="Once upon a time", raw=True,
                      options={"temperature": 0, "num_predict": 8})
    assert raw.response and raw.eval_count <= 8
    js = ol.chat(model="SmolLM2-135M-Instruct-Q4_1", format={"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}},
                                                             "required": ["colour"], "additionalProperties": False},
                 messages=[{"role": "user", "content": "Name a colour as JSON."}], options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(js.message.content)["colour"], str)


def test_ollama_sampler_options_reach_the_engine_seeded_and_reproducible(ol):
    """Ollama's options for llama.cpp's samplers (typical_p, mirostat, repeat_last_n) are the
    engine's samplers: a seeded request gives the same reply twice; Mirostat answers too."""
    ask = dict(model="SmolLM2-135M-Instruct-Q4_1", messages=ASK)
    base = {"temperature": 0.9, "seed": 11, "num_predict": 24}
    typical = [ol.chat(options={**base, "typical_p": 0.5, "repeat_last_n": 16}, **ask).message.content for _ in (0, 1)]
    mirostat = ol.chat(options={**base, "mirostat": 2, "mirostat_tau": 1.0}, **ask).message.content
    assert typical[0] == typical[1] and typical[0].strip() and mirostat.strip()
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(options={"mirostat": 3}, **ask)
    assert ei.value.status_code == 400 and "mirostat" in ei.value.error


def test_ollama_errors_and_the_load_request(ol, server):
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="no-such-model", messages=ASK)
    assert ei.value.status_code == 404 and "no-such-model" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="SmolLM2-135M-Instruct-Q4_1", messages=ASK, options={"warp": 9})
    assert ei.value.status_code == 400 and "warp" in ei.value.error
    # a prompt over the context is refused in Ollama's shape before any stream byte
    r = requests.post(server.url + "/api/chat", json={"model": "SmolLM2-135M-Instruct-Q4_1", "stream": True,
                                                      "messages": [{"role": "user", "content": "x " * 2000}]},
                      timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"} and "context" in r.json()["error"]
    r = requests.post(server.url + "/api/generate", json={"model": "SmolLM2-135M-Instruct-Q4_1"}, timeout=30).json()
    assert r["done"] and r["done_reason"] == "load"


# -- a hostile body on every API's chat route ----------------------------------------------------
MODEL = "SmolLM2-135M-Instruct-Q4_1"
# each API's chat route, its error shape, and a request it answers
CHAT_ROUTES = {
    "openai": ("/v1/chat/completions", "openai", {"messages": ASK, "max_tokens": 4}),
    "anthropic": ("/v1/messages", "anthropic", {"model": MODEL, "max_tokens": 4, "messages": ASK}),
    "ollama": ("/api/chat", "ollama", {"model": MODEL, "messages": ASK, "stream": False,
                                       "options": {"num_predict": 4}}),
    "responses": ("/v1/responses", "openai", {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 4}),
    "llama-server": ("/completion", "openai", {"prompt": "The capital of France is", "n_predict": 4}),
}


def error_message(body: dict, shape: str) -> str:
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    if shape == "ollama":
        assert set(body) == {"error"}
        return body["error"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize("api", list(CHAT_ROUTES))
def test_a_body_nested_100000_deep_is_a_4xx_in_the_apis_shape_and_the_next_is_answered(server, api):
    path, shape, ok = CHAT_ROUTES[api]
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = requests.post(server.url + path, data=deep, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "nests deeper than" in error_message(r.json(), shape)
    r = requests.post(server.url + path, json=ok, timeout=60)
    assert r.status_code == 200, r.text[:300]
