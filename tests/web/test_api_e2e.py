"""End to end through HTTP with the official `openai` client, against `appliance serve` on the
embedded SmolLM2-135M model: one server per runner (llama.cpp, and torch where installed),
each for the whole module. What the web layer and the engine's runner-independent parts do
(request shapes, bad input, streaming, stops, tools, structured output) is proven on llama.cpp;
what a runner's arithmetic decides (determinism, seeds, batching, logprobs, the prompt cache,
recall at depth, tokenizing) is proven on every runner (`@every_runner`)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import openai
import pytest
import requests

from ..engine.runner_kinds import KINDS
from .conftest import running_server

N_CTX = 1024
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three uses of copper.",
    "Explain in one sentence what a compiler does.",
]


every_runner = pytest.mark.every_runner


def pytest_generate_tests(metafunc):
    if "server" in metafunc.fixturenames:
        kinds = KINDS if metafunc.definition.get_closest_marker("every_runner") else ["llamacpp"]
        metafunc.parametrize("server", kinds, indirect=True, scope="module")


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    with running_server(tmp_path_factory.mktemp("srv"), "--engine", request.param,
                        "--n-ctx", str(N_CTX), "--n-slots", "4",
                        "--keepalive-s", "0.2", "--prefill-chunk", "128") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, q, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], **kw)


def stream_text(client, model, q, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    parts, chunks = [], []
    for chunk in client.chat.completions.create(model=model, stream=True,
                                                messages=[{"role": "user", "content": q}], **kw):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), chunks


def test_models_lists_the_served_model_with_its_context(server, client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct-Q4_1"
    raw = requests.get(server.url + "/v1/models").json()
    assert raw["data"][0]["context_length"] == N_CTX


@every_runner
def test_health_reports_the_engine(server):
    h = server.health()
    assert h["status"] == "ok" and h["n_ctx"] == N_CTX and h["n_slots"] == 4
    assert h["kv_bytes"] > 0 and h["engine_pid"] > 0
    assert h["settings"]["n_batch"] == 512 and h["backend"] in ("llama.cpp", "torch")
    assert h["settings"]["thread_wait"] == "spin"
    # the device check (issue 72): on by default; no layer on a GPU here, so skipped, saying why
    check = h["settings"]["device_check"]
    assert check["mode"] == "on" and check["verdict"] == "skipped" and check["why"], check
    # the start-up log says each thing once, for a person; the whole settings dict is /health's
    log = server.log()
    assert log.count("KV pool") == 1 and log.count(" loaded ") == 1 and "'n_batch'" not in log, log
    size, digest = h["model_fingerprint"].split(":")
    assert int(size) > 0 and len(digest) == 16
    if h["backend"] == "llama.cpp":  # where the fit planner put the model, as `appliance fit` prints it
        p = h["placement"]
        assert p["fits"] and p["kv_type"] == "f16" and p["n_slots"] == 4 and p["n_ctx"] == N_CTX
        assert p["devices"]["CPU"]["kv"] == h["kv_bytes"] and p["llama_devices"][0]["name"] == "CPU"


@every_runner
def test_chat_non_streamed(client, model):
    r = chat(client, model, QUESTIONS[0])
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    t = r.model_extra["timings"]
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens and t["predicted_per_second"] > 0


@every_runner
def test_chat_streamed_with_usage_matches_non_streamed(client, model):
    text, chunks = stream_text(client, model, QUESTIONS[1], stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and "timings" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert text == chat(client, model, QUESTIONS[1]).choices[0].message.content


def test_stream_ends_with_done_marker(server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    assert all(ln.startswith(b"data: ") for ln in lines)


@every_runner
def test_completion(client, model):
    r = client.completions.create(model=model, prompt="The first three planets are", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The first three planets are", max_tokens=12, temperature=0, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text


@every_runner
def test_temperature_zero_is_deterministic(client, model):
    a = chat(client, model, QUESTIONS[3], max_tokens=60).choices[0].message.content
    b = chat(client, model, QUESTIONS[3], max_tokens=60).choices[0].message.content
    assert a == b


@every_runner
def test_seed_reproduces_sampled_output(client, model):
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 40}
    a = chat(client, model, QUESTIONS[1], **kw).choices[0].message.content
    b = chat(client, model, QUESTIONS[1], **kw).choices[0].message.content
    others = {chat(client, model, QUESTIONS[1], **{**kw, "seed": s}).choices[0].message.content
              for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should give different samples"


def test_max_tokens_is_honoured(client, model):
    r = chat(client, model, "Count from one to one hundred in words.", max_tokens=7)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_stop_string_is_honoured_and_not_leaked(client, model):
    q = "Write a short sentence about the sea."
    text = chat(client, model, q, max_tokens=40).choices[0].message.content
    assert len(text) > 12
    stop = text[8:12]  # a stop string taken from the greedy output itself
    expected = text[: text.index(stop)]
    r = chat(client, model, q, max_tokens=40, stop=[stop, "@@never@@"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(client, model, q, stop=[stop])
    assert streamed == expected


def test_prompt_over_the_context_is_a_400_with_counts(client, model, server):
    long = "word " * (N_CTX + 50)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, long)
    err = e.value.body
    assert err["code"] == "context_length_exceeded"
    assert err["n_prompt_tokens"] > N_CTX and err["n_ctx"] == N_CTX
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": long}]}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["error"]["n_ctx"] == N_CTX
    n = err["n_prompt_tokens"]      # no max_tokens: what the user needs, never a negative max_tokens
    assert err["message"] == (f"the prompt alone is {n} tokens, over the context of {N_CTX} tokens per slot by "
                              f"{n - N_CTX}: shorten it by at least {n - N_CTX + 1} tokens to leave room for a reply")
    assert "max_tokens" not in err
    # prompt fits, but not with its max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "word " * (N_CTX - 100), max_tokens=200)
    n = e.value.body["n_prompt_tokens"]
    assert e.value.body["message"] == (f"this request needs {n} prompt tokens + 200 max_tokens, more than the context "
                                       f"of {N_CTX} tokens per slot: ask for at most {N_CTX - n} max_tokens or "
                                       "shorten the prompt")


@every_runner
@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_greedy_streams_match_alone_and_share_batches(client, model, server, n):
    alone = [stream_text(client, model, q, max_tokens=48)[0] for q in QUESTIONS[:n]]
    before = server.health()["engine"]["decode_batches"].get(str(n), 0)
    with cf.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda q: stream_text(client, model, q, max_tokens=48)[0], QUESTIONS[:n]))
    assert together == alone
    after = server.health()["engine"]["decode_batches"].get(str(n), 0)
    assert after > before, "the streams should have decoded together in one batch"


JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
BAD_INPUT = {  # API-CONTRACT.md's list: each a clean 4xx in OpenAI's shape
    "malformed JSON": ("/v1/chat/completions", dict(data=b"{not json", headers=JSON), 400),
    "invalid UTF-8": ("/v1/chat/completions", dict(data=b"\xff\xfe", headers=JSON), 400),
    "a form, not JSON": ("/v1/chat/completions", dict(data=b"messages=hi", headers={
        "Content-Type": "application/x-www-form-urlencoded"}), 400),
    "non-object body": ("/v1/chat/completions", dict(json=[1, 2]), 400),
    "missing messages": ("/v1/chat/completions", dict(json={"max_tokens": 3}), 400),
    "empty messages": ("/v1/chat/completions", dict(json={"messages": []}), 400),
    "unknown role": ("/v1/chat/completions", dict(json={"messages": [{"role": "wizard", "content": "hi"}]}), 400),
    "model not a string": ("/v1/chat/completions", dict(json={"model": 7, "messages": HI}), 400),
    "max_tokens 0": ("/v1/chat/completions", dict(json={"messages": HI, "max_tokens": 0}), 400),
    "max_tokens too large": ("/v1/chat/completions", dict(json={"messages": HI, "max_tokens": 10**6}), 400),
    "temperature out of range": ("/v1/chat/completions", dict(json={"messages": HI, "temperature": 7}), 400),
    "top_p out of range": ("/v1/chat/completions", dict(json={"messages": HI, "top_p": 1.5}), 400),
    "n 0": ("/v1/chat/completions", dict(json={"messages": HI, "n": 0}), 400),
    "invalid JSON schema": ("/v1/chat/completions", dict(json={"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}), 400),
    "malformed tools": ("/v1/chat/completions", dict(json={"messages": HI, "tools": [{"type": "function"}]}), 400),
    "unknown tool_choice": ("/v1/chat/completions", dict(json={"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}), 400),
    "out-of-vocabulary token ids": ("/v1/completions", dict(json={"prompt": [1, 2, 10**9]}), 400),
    "tokenize without content": ("/tokenize", dict(json={"add_special": True}), 400),
    "tokenize with a non-boolean flag": ("/tokenize", dict(json={"content": "hi", "with_pieces": "yes"}), 400),
    "detokenize an out-of-vocabulary id": ("/detokenize", dict(json={"tokens": [1, 49152]}), 400),
    "detokenize a negative id": ("/detokenize", dict(json={"tokens": [-1]}), 400),
    "detokenize without a list of ids": ("/detokenize", dict(json={"tokens": "1 2"}), 400),
    "stream_options without stream": ("/v1/chat/completions", dict(json={"messages": HI, "stream_options": {}}), 400),
    "oversized body": ("/v1/chat/completions", dict(data=b'{"messages": [{"role":"user","content":"' +
                                                    b"x" * (9 << 20) + b'"}]}', headers=JSON), 413),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gets_openai_shaped_4xx_and_server_keeps_serving(server, client, model, case):
    path, kwargs, status = BAD_INPUT[case]
    r = requests.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert chat(client, model, "Say hi.", max_tokens=1).choices[0].message is not None


def test_unknown_routes_and_methods(server):
    assert requests.get(server.url + "/v1/nothing").status_code == 404
    assert requests.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert requests.get(server.url + "/v1/chat/completions").status_code == 405


def test_foreign_host_header_is_refused(server):
    r = requests.get(server.url + "/v1/models", headers={"Host": "evil.example:8080"})
    assert r.status_code == 403
    r = requests.post(server.url + "/tokenize", json={"content": "hi"}, headers={"Host": "evil.example:8080"})
    assert r.status_code == 403


def test_chat_page_is_served(server):
    page = requests.get(server.url + "/")
    assert page.status_code == 200 and "chat.js" in page.text
    js = requests.get(server.url + "/static/app/chat.js")
    assert js.status_code == 200 and "ChatJobs.run" in js.text and "timings" in js.text
    jobs = requests.get(server.url + "/static/app/chat_jobs.js")   # the server generates the reply
    assert jobs.status_code == 200 and "/jobs" in jobs.text and "/events" in jobs.text


def test_a_final_assistant_message_is_continued(client, model):
    # greedy: the reply continued from its own first words is the rest of the same reply
    q = "What is the capital of France?"
    whole = chat(client, model, q, max_tokens=24).choices[0].message.content
    head = " ".join(whole.split(" ")[:4])
    assert len(head) < len(whole)
    rest = client.chat.completions.create(model=model, temperature=0, max_tokens=24 - 6, messages=[
        {"role": "user", "content": q}, {"role": "assistant", "content": head}]).choices[0].message.content
    assert whole.startswith(head + rest[:10]) and rest[:10].strip()


@every_runner
def test_logprobs_chat_and_completion(client, model):
    r = chat(client, model, QUESTIONS[0], max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-9
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, temperature=0,
        stream=True, logprobs=True, top_logprobs=3, stop=["@@"]) if c.choices]
    # every chunk that carries a token carries its logprob, and none carries empty content but the first
    assert all((ch.delta.content is not None) == (ch.logprobs is not None) for ch in chunks[1:])
    assert all(ch.delta.content != "" for ch in chunks[1:]) and chunks[0].delta.content == ""
    assert all("".join(e.token for e in ch.logprobs.content) == ch.delta.content for ch in chunks if ch.logprobs)
    streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [(e.token, round(e.logprob, 6)) for e in content]
    c = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and all(x <= 0 for x in lp.token_logprobs)
    assert chat(client, model, "Hi", max_tokens=3).choices[0].logprobs is None


@every_runner
def test_logit_bias_bans_and_favours_tokens(client, model, server):
    q = QUESTIONS[2]
    greedy = chat(client, model, q, max_tokens=8, logprobs=True)
    first = greedy.choices[0].logprobs.content[0].token
    (tok,) = requests.post(server.url + "/tokenize", json={"content": first}, timeout=30).json()["tokens"]
    banned = chat(client, model, q, max_tokens=8, logprobs=True, logit_bias={str(tok): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    assert not any(e.token == first for e in banned.choices[0].logprobs.content)   # -100 is a ban, at every step
    (x,) = requests.post(server.url + "/tokenize", json={"content": " zebra"}, timeout=30).json()["tokens"]
    forced = chat(client, model, q, max_tokens=3, logit_bias={str(x): 100}, temperature=0.8, seed=3)
    assert forced.choices[0].message.content == " zebra" * 3
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, q, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary" in e.value.body["message"]


def test_n_choices_share_one_prefill_streamed_and_not(client, model, server):
    kw = {"temperature": 0.9, "seed": 11, "max_tokens": 10}
    alone = chat(client, model, QUESTIONS[1], **kw)
    r = chat(client, model, QUESTIONS[1], n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.choices[0].message.content == alone.choices[0].message.content
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens                      # the prompt counted once
    assert r.usage.completion_tokens == 3 * 10 and r.model_extra["timings"]["prompt_n"] <= alone.usage.prompt_tokens
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                stream=True, n=3, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in r.choices} and finishes == {0: "length", 1: "length", 2: "length"}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "Hi", n=5)
    assert e.value.body["message"] == ("n=5 asks for more choices than this server generates at once: at most 4 "
                                       "(each choice takes a slot; --max-choices 4, --n-slots 4)")


def test_keepalive_comments_while_a_long_prompt_is_processed(server, model):
    body = {"model": model, "stream": True, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "word " * (N_CTX - 150)}]}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    keepalives = [i for i, ln in enumerate(lines) if ln == b": keep-alive"]
    first_token = next(i for i, ln in enumerate(lines) if ln.startswith(b"data: {") and i > 0)
    assert lines[0].startswith(b"data: {") and b'"role":"assistant"' in lines[0]
    assert keepalives and keepalives == list(range(1, first_token)), lines[:first_token + 1]
    assert lines[-1] == b"data: [DONE]"


def test_metrics_in_prometheus_format(server, client, model):
    chat(client, model, "Say hi.", max_tokens=3)
    requests.post(server.url + "/v1/chat/completions", json={"messages": []})
    text = requests.get(server.url + "/metrics").text
    assert 'appliance_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert 'appliance_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    for name in ("appliance_time_to_first_token_seconds_count", "appliance_inter_token_seconds_bucket",
                 "appliance_prompt_tokens_total", "appliance_generated_tokens_total", "appliance_queue_depth",
                 "appliance_slots_busy", "appliance_kv_pool_bytes", "appliance_kv_used_tokens",
                 "appliance_prompt_cache_hit_tokens_total", "appliance_draft_tokens_accepted_total"):
        assert name in text, name
    assert "appliance_slots 4.0" in text
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["appliance_time_to_first_token_seconds"]
    assert next(s.value for s in ttft.samples if s.name.endswith("_count")) > 0


def test_json_object_output_parses(client, model):
    r = chat(client, model, "Give me a JSON object with a name and an age.", max_tokens=200,
             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_output_validates(client, model, stream):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    if stream:
        text, _ = stream_text(client, model, "Invent a person.", max_tokens=200, response_format=fmt)
    else:
        text = chat(client, model, "Invent a person.", max_tokens=200, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_invalid_json_schema_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, "x", response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "objectx"}}})
    assert e.value.body["param"] == "response_format"
    assert chat(client, model, "Say hi.", max_tokens=3).choices[0].message.content


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def ask_tools(client, model, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=model, temperature=0, tools=TOOLS,
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}], **kw)


def test_tool_choice_required_gives_a_valid_call(client, model):
    r = ask_tools(client, model, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert set(args) == ({"city"} if call.function.name == "get_weather" else {"tz"})


def test_named_tool_choice_is_never_downgraded(client, model):
    r = ask_tools(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert isinstance(json.loads(calls[0].function.arguments)["tz"], str)


def test_tool_choice_none_gives_no_call(client, model):
    r = ask_tools(client, model, tool_choice="none", max_tokens=40)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_tool_choice_auto_is_well_formed(client, model):
    r = ask_tools(client, model, tool_choice="auto", max_tokens=80)
    msg = r.choices[0].message
    if msg.tool_calls:  # the 135M model may or may not call: either way the shape is right
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in msg.tool_calls)
    else:
        assert msg.content is not None


def test_streamed_tool_calls_in_openai_chunk_shape(client, model):
    stream = ask_tools(client, model, tool_choice="required", stream=True)
    heads, args, finish = {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                assert tc.type == "function" and tc.function.name
                heads[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and heads and set(heads) == set(args)
    assert all(isinstance(json.loads(a), dict) for a in args.values())
    non_streamed = ask_tools(client, model, tool_choice="required").choices[0].message.tool_calls
    assert [heads[i] for i in sorted(heads)] == [c.function.name for c in non_streamed]


def test_tool_result_round_trip(client, model):
    call = ask_tools(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                     parallel_tool_calls=False).choices[0].message.tool_calls[0]
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=40, tools=TOOLS, messages=[
        {"role": "user", "content": "What is the weather in Paris right now?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees Celsius and sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 60  # the call and its result were rendered into the prompt


def test_a_slow_reader_does_not_stall_another_stream(server, model):
    slow_body = {"model": model, "stream": True, "max_tokens": 400, "ignore_eos": True,
                 "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with requests.post(server.url + "/v1/chat/completions", json=slow_body, stream=True, timeout=120) as slow:
        lines = slow.iter_lines()
        next(lines)  # the slow client reads one line, then nothing while the other stream runs
        text, status = stream_text_raw(server, model)
        # the other stream finished while the slow one is still being generated, unread
        assert status == 200 and text and server.health()["engine"]["slots_busy"] >= 1
        rest = [ln for ln in lines if ln]
    assert rest[-1] == b"data: [DONE]"


def stream_text_raw(server, model):
    body = {"model": model, "stream": True, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Name two colors."}]}
    parts = []
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                for c in json.loads(line[6:])["choices"]:
                    parts.append(c["delta"].get("content") or "")
    return "".join(parts), r.status_code


FILLER = ("The river flows past the old mill and the farmers bring their grain to the market every week. " * 80
          ).split(". ")


def needle_prompt(n_sentences: int, code: str) -> str:
    sents = FILLER[:n_sentences]
    sents.insert(len(sents) // 3, f"The secret code is {code}")  # a third of the way in
    return ". ".join(sents) + ".\n\nWhat is the secret code? Answer with the number only."


@every_runner
@pytest.mark.parametrize("n_sentences,code", [(5, "4817"), (20, "93015"), (40, "27364"), (48, "58102")])
def test_recall_of_a_planted_code_up_to_the_context_limit(client, model, n_sentences, code):
    r = chat(client, model, needle_prompt(n_sentences, code), max_tokens=12)
    assert code in r.choices[0].message.content
    assert r.usage.prompt_tokens + 12 <= N_CTX


def test_planted_code_past_the_context_limit_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, needle_prompt(len(FILLER), "11111"), max_tokens=12)
    assert e.value.body["n_prompt_tokens"] > N_CTX - 12


STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 30


@every_runner
@pytest.mark.parametrize("kind", ["resend", "half prefix", "extended"])
def test_prompt_cache_hit_is_exactly_the_cold_answer(client, model, server, kind):
    first = [{"role": "user", "content": STORY}]
    n_first = chat(client, model, STORY, max_tokens=4).usage.prompt_tokens  # leaves the prompt in a slot
    follow = {"resend": first,
              "half prefix": [{"role": "user", "content": STORY[: len(STORY) // 2]}],
              "extended": first + [{"role": "assistant", "content": "He lit it."},
                                   {"role": "user", "content": "What happened one stormy night?"}]}[kind]
    kw = dict(model=model, messages=follow, temperature=0, max_tokens=16, logprobs=True, top_logprobs=5)
    warm = client.chat.completions.create(**kw)
    cold = client.chat.completions.create(**kw, extra_body={"cache_prompt": False})
    assert warm.usage.prompt_tokens_details.cached_tokens >= 128
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    # to the token where the engine proved it exact at start (llama.cpp here: leaving 2 tokens to
    # compute; torch: 1), else in whole 128-token blocks
    m = requests.get(server.url + "/health", timeout=10).json()["settings"]["prompt_cache_reuse"]["min_chunk"]
    expected = {"resend": n_first - m if m else (n_first - 1) // 128 * 128,
                "extended": n_first if m else n_first // 128 * 128}.get(kind)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    if kind == "extended" and m:
        # and, once the engine settled the 4-token reply while idle, what it shares with "He lit it."
        assert expected <= cached <= expected + 4
    elif expected is not None:
        assert cached == expected
    assert warm.model_extra["timings"]["cache_reuse"] == "exact"
    assert warm.model_extra["timings"]["cache_n"] == warm.usage.prompt_tokens_details.cached_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    first_warm, first_cold = warm.choices[0].logprobs.content[0], cold.choices[0].logprobs.content[0]
    assert [(t.token, t.logprob) for t in first_warm.top_logprobs] == \
        [(t.token, t.logprob) for t in first_cold.top_logprobs]


def settled_tokens(server) -> int:
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("appliance_prompt_cache_settled_tokens_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no settled tokens counter in /metrics")


@every_runner
def test_the_next_turn_reuses_the_reply_settled_while_idle_and_gives_the_cold_answer(client, model, server):
    # both runners prove reuse to the token here (llama.cpp m = 2, torch m = 17): replies settle
    assert requests.get(server.url + "/health", timeout=10).json()["settings"]["prompt_cache_reuse"]["min_chunk"] > 0
    before = settled_tokens(server)
    turn = [{"role": "user", "content": STORY + " Tell me about the keeper."}]
    first = client.chat.completions.create(model=model, messages=turn, temperature=0, max_tokens=24)
    n_reply = first.usage.completion_tokens
    deadline = time.monotonic() + 30   # the engine settles while idle, and reports ten times a second
    while settled_tokens(server) < before + n_reply - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled_tokens(server) >= before + n_reply - 1
    follow = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    kw = dict(model=model, messages=follow, temperature=0, max_tokens=16, logprobs=True, top_logprobs=5)
    warm = client.chat.completions.create(**kw)
    cold = client.chat.completions.create(**kw, extra_body={"cache_prompt": False})
    # the prompt and the reply (as the template writes it back) from the cache, exactly
    assert warm.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens + n_reply // 2
    assert warm.model_extra["timings"]["cache_reuse"] == "exact"
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in warm.choices[0].logprobs.content] == \
        [[(t.token, t.logprob) for t in c.top_logprobs] for c in cold.choices[0].logprobs.content]


# -- llama-server's /tokenize and /detokenize ---------------------------------------------------

TEXT = "Héllo wörld, 日本語 😀 and <|im_start|> in code."


def tokenize(server, content, **kw):
    r = requests.post(server.url + "/tokenize", json={"content": content, **kw}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()["tokens"]


def detokenize(server, ids):
    r = requests.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()["content"]


@every_runner
def test_tokenize_then_detokenize_round_trips(server):
    ids = tokenize(server, TEXT)
    assert ids and all(isinstance(t, int) for t in ids)
    assert detokenize(server, ids) == TEXT
    assert tokenize(server, "") == [] and detokenize(server, []) == ""


def test_parse_special_decides_whether_special_tokens_are_parsed(server):
    special = tokenize(server, "<|im_start|>")  # parse_special defaults to true
    assert len(special) == 1
    plain = tokenize(server, "<|im_start|>", parse_special=False)
    assert len(plain) > 1 and detokenize(server, plain) == "<|im_start|>"


def _added_specials() -> tuple[int | None, int | None]:
    """The BOS and EOS ids llama.cpp adds with add_special for the embedded model (None when it
    adds none), read from the vocabulary alone."""
    import llama_cpp as L

    from appliance.models import embedded_model_path
    params = L.llama_model_default_params()
    params.vocab_only = True
    m = L.llama_model_load_from_file(str(embedded_model_path()).encode(), params)
    try:
        v = L.llama_model_get_vocab(m)
        return (L.llama_vocab_bos(v) if L.llama_vocab_get_add_bos(v) else None,
                L.llama_vocab_eos(v) if L.llama_vocab_get_add_eos(v) else None)
    finally:
        L.llama_model_free(m)


@every_runner
def test_add_special_adds_the_bos_only_if_the_model_adds_one(server):
    bos, eos = _added_specials()
    without = tokenize(server, TEXT)
    with_special = tokenize(server, TEXT, add_special=True)
    assert with_special == [bos] * (bos is not None) + without + [eos] * (eos is not None)


@every_runner
def test_with_pieces_concatenate_to_the_text(server):
    tokens = tokenize(server, TEXT, with_pieces=True)
    assert [t["id"] for t in tokens] == tokenize(server, TEXT)
    raw = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens)
    assert raw.decode() == TEXT
    # the emoji and the CJK characters span several tokens: some pieces are bytes, not text
    assert any(isinstance(t["piece"], list) for t in tokens)


def test_detokenize_bad_id_is_a_400_naming_the_tokens(server):
    r = requests.post(server.url + "/detokenize", json={"tokens": [1, 10**12]}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tokens" and err["code"] == "invalid_token" and str(10**12) in err["message"]


def test_tokenize_only_at_llama_server_paths(server):
    assert requests.post(server.url + "/v1/tokenize", json={"content": "hi"}).status_code == 404
    assert requests.get(server.url + "/tokenize").status_code == 405


@every_runner
def test_token_count_agrees_with_completion_usage(client, model, server):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(tokenize(server, prompt, add_special=True))
