"""The OpenAI wire format: body parsing, validation (400 with the right param), SSE chunks."""
from __future__ import annotations

import json

import pytest

from appliance.engine.types import ChatMessage, Constraint, Delta, Done, SamplingParams, Timings, Tokenized, Usage
from appliance.errors import EngineCrashed, InvalidRequest, ModelNotFound
from web.responses import ChunkWriter
from web.tokens import parse_detokenize, parse_tokenize, tokenize_response
from web.wire import parse_chat, parse_completion, parse_json_body

MODEL = "smollm2"
SERVED = {MODEL}
N_CTX = 2048
USER = [{"role": "user", "content": "hi"}]


def chat(**body):
    body.setdefault("messages", USER)
    return parse_chat(body, "chatcmpl-1", SERVED, N_CTX)


def completion(**body):
    body.setdefault("prompt", "Once upon")
    return parse_completion(body, "cmpl-1", SERVED, N_CTX)


def completion_error_message(**body) -> str:
    with pytest.raises(InvalidRequest) as ei:
        completion(**body)
    return ei.value.message


def chat_error(**body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as ei:
        chat(**body)
    assert ei.value.status == 400
    return ei.value


# -- parse_json_body -----------------------------------------------------------------------------

def test_json_body_parses_an_object():
    # whatever the request's content type: it is not read (web/origins.py says why)
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_json_body_invalid_utf8():
    with pytest.raises(InvalidRequest) as ei:
        parse_json_body(b'{"a": "\xff\xfe"}')
    assert ei.value.status == 400 and "UTF-8" in ei.value.message


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": }', b"{'a': 1}", b'{"a": 1} x', b"model=m&prompt=hi"])
def test_json_body_malformed(raw):
    with pytest.raises(InvalidRequest) as ei:
        parse_json_body(raw)
    assert ei.value.status == 400 and "not valid JSON" in ei.value.message


@pytest.mark.parametrize("raw,kind", [(b"[1, 2]", "list"), (b'"s"', "str"), (b"3", "int"),
                                      (b"null", "NoneType")])
def test_json_body_must_be_an_object(raw, kind):
    with pytest.raises(InvalidRequest) as ei:
        parse_json_body(raw)
    assert kind in ei.value.message


# -- parse_chat: errors -------------------------------------------------------------------------

def test_missing_messages():
    with pytest.raises(InvalidRequest) as ei:
        parse_chat({"model": MODEL}, "r", SERVED, N_CTX)
    assert ei.value.param == "messages"


@pytest.mark.parametrize("messages", [[], {}, "hi"])
def test_empty_or_non_list_messages(messages):
    assert chat_error(messages=messages).param == "messages"


def test_unknown_role():
    e = chat_error(messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert e.param == "messages[1].role"


def test_missing_role():
    assert chat_error(messages=[{"content": "a"}]).param == "messages[0].role"


def test_non_object_message():
    assert chat_error(messages=[{"role": "user", "content": "a"}, "b"]).param == "messages[1]"


def test_non_text_content_part():
    e = chat_error(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert e.param == "messages[0].content"
    e = chat_error(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert e.param == "messages[0].content[0]"    # an image part without its url (web/images.py)


def test_bad_content_type():
    assert chat_error(messages=[{"role": "user", "content": 5}]).param == "messages[0].content"


@pytest.mark.parametrize("value", [0, -1, N_CTX + 1, True, 1.5, "10"])
def test_bad_max_tokens(value):
    assert chat_error(max_tokens=value).param == "max_tokens"


def test_bad_max_completion_tokens():
    assert chat_error(max_completion_tokens=0).param == "max_completion_tokens"


@pytest.mark.parametrize("key,value", [
    ("temperature", 3), ("temperature", -0.1), ("temperature", "hot"), ("temperature", True),
    ("top_p", 1.5), ("top_p", -0.5), ("min_p", 2), ("top_k", -1), ("top_k", 2.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("seed", "x"),
    ("stop", 5), ("stop", ["a", 1]), ("stop", [str(i) for i in range(17)]),
    ("stream", "yes"),
])
def test_bad_sampling_values_name_the_param(key, value):
    assert chat_error(**{key: value}).param == key


def test_non_finite_temperature():
    assert chat_error(temperature=float("nan")).param == "temperature"


def test_n_choices_are_carried_to_the_engine_and_bounded():
    assert chat(n=3).request.n == 3 and completion(n=2).request.n == 2
    for bad in (0, -1, 129, "2", True, 1.5):
        assert chat_error(n=bad).param == "n"


def test_n_one_or_null_is_accepted():
    assert chat(n=1).request.messages
    assert chat(n=None).request.messages


def test_stream_options_without_stream():
    assert chat_error(stream_options={"include_usage": True}).param == "stream_options"
    assert chat_error(stream=False, stream_options={}).param == "stream_options"


def test_stream_options_must_be_an_object():
    assert chat_error(stream=True, stream_options=[1]).param == "stream_options"


@pytest.mark.parametrize("key,value", [
    ("functions", [{"name": "f"}]),
    ("top_logprobs", 3),  # without logprobs: true
])
def test_not_yet_supported_parameters_are_refused(key, value):
    assert chat_error(**{key: value}).param == key


def test_an_unsupported_parameter_is_refused_word_for_word():
    e = chat_error(functions=[{"name": "f"}])
    assert e.message == "'functions' (the deprecated 'functions' (use 'tools')) is not supported by this server version"
    assert completion_error_message(echo=True) == "'echo' (echo) is not supported by this server version"


def test_logit_bias_is_token_ids_to_biases():
    assert chat(logit_bias={"50256": -100, "15": 2.5}).request.params.logit_bias == ((50256, -100.0), (15, 2.5))
    assert completion(logit_bias={"7": 100}).request.params.logit_bias == ((7, 100.0),)
    assert chat(logit_bias={}).request.params.logit_bias == () == chat(logit_bias=None).request.params.logit_bias


@pytest.mark.parametrize("value,message", [
    ([[15, -1]], "'logit_bias' must be an object from token ids to biases, e.g. {\"1734\": -100}"),
    ({"hello": 1}, "'logit_bias' keys must be token ids (non-negative integers); got 'hello'"),
    ({"-3": 1}, "'logit_bias' keys must be token ids (non-negative integers); got '-3'"),
    ({"\u00b2": 1}, "'logit_bias' keys must be token ids (non-negative integers); got '\u00b2'"),
    ({"15": 101}, "logit_bias['15'] must be a number between -100 and 100; got 101"),
    ({"15": "1"}, "logit_bias['15'] must be a number between -100 and 100; got '1'"),
    ({"15": False}, "logit_bias['15'] must be a number between -100 and 100; got False"),
])
def test_bad_logit_bias_is_refused_word_for_word(value, message):
    e = chat_error(logit_bias=value)
    assert (e.param, e.message) == ("logit_bias", message)


@pytest.mark.parametrize("key,value", [("tools", []), ("response_format", {"type": "text"}),
                                       ("logprobs", False), ("tools", None)])
def test_harmless_forms_of_unsupported_parameters_pass(key, value):
    assert chat(**{key: value}).request.messages


def test_malformed_tool_calls_in_messages_refused():
    e = chat_error(messages=[{"role": "assistant", "content": None,
                              "tool_calls": [{"id": "1", "type": "function"}]}])
    assert e.param == "messages[0].tool_calls[0]"
    e = chat_error(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}])
    assert e.param == "messages[0].tool_calls[0].function.arguments"
    assert chat_error(messages=[{"role": "tool", "content": "42"}]).param == "messages[0].tool_call_id"


def test_chat_template_kwargs_must_be_an_object():
    assert chat_error(chat_template_kwargs=[1]).param == "chat_template_kwargs"


def test_unknown_model_is_404():
    with pytest.raises(ModelNotFound) as ei:
        chat(model="gpt-4o")
    assert ei.value.status == 404 and ei.value.param == "model"
    assert MODEL in ei.value.message


def test_model_must_be_a_string():
    assert chat_error(model=3).param == "model"


# -- parse_chat: valid requests -----------------------------------------------------------------

def test_valid_chat_request():
    p = chat(model=MODEL, temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, seed=3,
             max_tokens=100, stop="\n\n", presence_penalty=0.5, frequency_penalty=0.25,
             repeat_penalty=1.1, ignore_eos=True, user="ignored", metadata={"a": "b"})
    assert p.model == MODEL and p.stream is False and p.include_usage is False
    assert p.request.id == "chatcmpl-1"
    assert p.request.messages == (ChatMessage("user", "hi"),)
    assert p.request.params == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, seed=3, max_tokens=100, stop=("\n\n",),
        ignore_eos=True)


def test_chat_defaults():
    p = parse_chat({"messages": USER}, "r", SERVED, N_CTX)
    assert p.model == MODEL
    assert p.request.params == SamplingParams()  # max_tokens None: the engine's default applies
    assert p.request.prompt is None and p.request.prompt_ids is None


def test_stop_list_to_tuple_dropping_empty():
    assert chat(stop=["a", "", "b"]).request.params.stop == ("a", "b")


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_completion_tokens=5, max_tokens=50).request.params.max_tokens == 5


def test_max_tokens_up_to_n_ctx_is_accepted():
    assert chat(max_tokens=N_CTX).request.params.max_tokens == N_CTX


def test_developer_role_maps_to_system_and_parts_are_joined():
    p = chat(messages=[
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                     {"type": "text", "text": "world"}], "name": "ann"},
        {"role": "assistant", "content": None},
    ])
    assert p.request.messages == (ChatMessage("system", "be terse"),
                                  ChatMessage("user", "Hello, world", "ann"),
                                  ChatMessage("assistant", None))


def test_stream_with_usage():
    p = chat(stream=True, stream_options={"include_usage": True})
    assert p.stream is True and p.include_usage is True


def test_chat_template_kwargs_are_passed_sorted():
    p = chat(chat_template_kwargs={"b": 1, "a": True})
    assert p.request.template_kwargs == (("a", True), ("b", 1))


# -- parse_completion ---------------------------------------------------------------------------

def test_several_prompts_are_a_request_each_under_the_batchs_id():
    p = completion(prompt=["a", [5, 6]], n=2)
    assert [(r.id, r.prompt, r.prompt_ids, r.n) for r in p.batch] == [("cmpl-1-0", "a", None, 2),
                                                                      ("cmpl-1-1", None, (5, 6), 2)]
    assert (p.request.id, p.request.prompt) == ("cmpl-1", "a") and completion().batch == ()


def test_completion_defaults_to_16_tokens():
    p = completion()
    assert p.request.prompt == "Once upon" and p.request.prompt_ids is None
    assert p.request.messages is None
    assert p.request.params.max_tokens == 16


def test_completion_prompt_as_token_ids():
    p = completion(prompt=[1, 2, 3], max_tokens=4)
    assert p.request.prompt_ids == (1, 2, 3) and p.request.prompt is None
    assert p.request.params.max_tokens == 4


@pytest.mark.parametrize("prompt,text,ids", [(["hello"], "hello", None), ([[5, 6]], None, (5, 6))])
def test_completion_prompt_as_one_element_list(prompt, text, ids):
    p = completion(prompt=prompt)
    assert p.request.prompt == text and p.request.prompt_ids == ids


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], [True, 2], 5, {"a": 1}, [[1, "a"]]])
def test_completion_bad_prompt(prompt):
    body = {"prompt": prompt} if prompt is not None else {}
    with pytest.raises(InvalidRequest) as ei:
        parse_completion(body, "r", SERVED, N_CTX)
    assert ei.value.param == "prompt"


@pytest.mark.parametrize("key,value", [("max_tokens", 0), ("echo", True), ("suffix", "x"),
                                       ("best_of", 2), ("n", 0)])
def test_completion_errors_name_the_param(key, value):
    with pytest.raises(InvalidRequest) as ei:
        completion(**{key: value})
    assert ei.value.param == key


def test_completion_unknown_model():
    with pytest.raises(ModelNotFound):
        completion(model="other")


# -- ChunkWriter ---------------------------------------------------------------------------------

DONE = Done("chatcmpl-1", "stop", Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2),
            Timings(prompt_n=5, cache_n=2, prompt_ms=10.0, predicted_n=2, predicted_ms=20.0,
                    queue_ms=0.5, n_ctx=N_CTX))


def events(data: bytes) -> list:
    assert data.endswith(b"\n\n")
    out = []
    for block in data.decode().split("\n\n")[:-1]:
        assert block.startswith("data: ")
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_chunks():
    p = chat(stream=True)
    w = ChunkWriter(p, chat=True, fingerprint="fp")
    (first,) = events(w.start())
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-1"
    assert first["model"] == MODEL and first["system_fingerprint"] == "fp"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None

    (delta,) = events(w.delta(Delta("id-1", "Hel", ())))
    assert delta["choices"][0]["delta"] == {"content": "Hel"}

    tail = events(w.end(DONE))
    assert tail[-1] == "[DONE]"
    assert w.end(DONE).endswith(b"data: [DONE]\n\n")
    assert len(tail) == 2  # no usage chunk unless asked
    final = tail[0]
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["choices"][0]["delta"] == {}
    assert final["timings"]["predicted_n"] == 2
    assert "usage" not in final


def test_chat_chunks_with_usage():
    p = chat(stream=True, stream_options={"include_usage": True})
    tail = events(ChunkWriter(p, chat=True, fingerprint="fp").end(DONE))
    assert len(tail) == 3 and tail[-1] == "[DONE]"
    usage_chunk = tail[1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                    "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_chunks():
    p = completion(stream=True)
    w = ChunkWriter(p, chat=False, fingerprint="fp")
    assert w.start() == b""
    (delta,) = events(w.delta(Delta("id-1", "abc", ())))
    assert delta["object"] == "text_completion"
    assert delta["choices"][0]["text"] == "abc"
    tail = events(w.end(DONE))
    assert tail[0]["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                     "finish_reason": "stop"}
    assert tail[-1] == "[DONE]"


def test_error_chunk():
    out = ChunkWriter.error(EngineCrashed("boom"))
    assert events(out) == [{"error": {"message": "boom", "type": "server_error", "param": None,
                                      "code": "engine_crashed"}}]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", ["plain", 'quo"te\\ and\nnewline', "é ünïcode \u2028 \x00"])
def test_fast_delta_chunk_equals_the_generic_encoding(chat, text):
    p = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "id-1", SERVED, N_CTX)
    w = ChunkWriter(p, chat=chat, fingerprint="fp")
    w.delta(Delta("id-1", "warm the cache", ()))
    assert json.loads(w.delta(Delta("id-1", text, ()))[6:]) == json.loads(w._chunk(w._choice(text, None))[6:])
    assert w.delta(Delta("id-1", "", ())) == b""      # no chunk of empty content (OpenAI sends none)


def test_logprobs_parameters():
    p = chat(logprobs=True, top_logprobs=5).request.params
    assert p.logprobs and p.top_logprobs == 5
    assert chat_error(logprobs=True, top_logprobs=21).param == "top_logprobs"
    c = parse_completion({"prompt": "x", "logprobs": 2}, "id-2", SERVED, N_CTX).request.params
    assert c.logprobs and c.top_logprobs == 2
    assert not parse_completion({"prompt": "x"}, "id-3", SERVED, N_CTX).request.params.logprobs


def test_logprob_chunks_carry_openai_shapes():
    from appliance.engine.types import TokenLogprob, TopLogprob

    e = TokenLogprob("Hi", (72, 105), -0.5, (TopLogprob("Hi", (72, 105), -0.5), TopLogprob("Yo", (89, 111), -1.5)))
    p = chat(stream=True, logprobs=True, top_logprobs=2)
    choice = json.loads(ChunkWriter(p, chat=True, fingerprint="fp").delta(Delta("id-1", "Hi", (1,), (e,)))[6:])["choices"][0]
    content = choice["logprobs"]["content"]
    assert content == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                        "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                         {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}]
    pc = parse_completion({"prompt": "x", "logprobs": 2, "stream": True}, "id-2", SERVED, N_CTX)
    w = ChunkWriter(pc, chat=False, fingerprint="fp")
    w.delta(Delta("id-2", "Hi", (1,), (e,)))
    second = json.loads(w.delta(Delta("id-2", "Hi", (1,), (e,)))[6:])["choices"][0]["logprobs"]
    assert second == {"tokens": ["Hi"], "token_logprobs": [-0.5], "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}],
                      "text_offset": [2]}


def test_logprobs_ride_on_the_last_chunk_a_delta_makes_and_never_on_empty_content():
    from appliance.engine.types import TokenLogprob, ToolCallPart

    e = TokenLogprob("x", (120,), -0.25)
    w = ChunkWriter(chat(stream=True, logprobs=True), chat=True, fingerprint="fp")
    (only,) = events(w.delta(Delta("id-1", "", (1,), (e,), reasoning="thinking")))
    assert only["choices"][0]["delta"] == {"reasoning_content": "thinking"}
    assert only["choices"][0]["logprobs"]["content"][0]["token"] == "x"
    head, args = events(w.delta(Delta("id-1", "", (1,), (e, e), call_parts=(
        ToolCallPart(0, "call_1", "f"), ToolCallPart(0, arguments="{}")))))
    assert head["choices"][0]["logprobs"] is None and len(args["choices"][0]["logprobs"]["content"]) == 2
    assert all("content" not in c["choices"][0]["delta"] for c in (only, head, args))


def test_choices_stream_interleaved_with_their_index():
    from appliance.engine.types import ChoiceEnd

    p = chat(stream=True, n=2)
    w = ChunkWriter(p, chat=True, fingerprint="fp")
    assert [c["choices"][0]["index"] for c in events(w.start())] == [0, 1]
    (second,) = events(w.delta(Delta("id-1", "B", (1,), index=1)))
    assert second["choices"][0] == {"index": 1, "delta": {"content": "B"}, "logprobs": None, "finish_reason": None}
    done = Done("chatcmpl-1", "stop", Usage(5, 6), DONE.timings,
                choices=(ChoiceEnd(0, "stop"), ChoiceEnd(1, "length")))
    tail = events(w.end(done))
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in tail[:2]] == [(0, "stop"), (1, "length")]
    assert "timings" in tail[1] and tail[-1] == "[DONE]"


def test_a_whole_reply_has_a_choice_per_index():
    from appliance.engine.types import ChoiceEnd
    from web.responses import chat_response, completion_response

    done = Done("chatcmpl-1", "stop", Usage(5, 3), DONE.timings, choices=(ChoiceEnd(0, "stop"), ChoiceEnd(1, "length")))
    deltas = [Delta("id-1", "A", (1,)), Delta("id-1", "B", (2,), index=1), Delta("id-1", "a", (3,)),
              Delta("id-1", "b", (4,), index=1)]
    body = chat_response(chat(n=2), deltas, done, "fp")
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "Aa", "stop"), (1, "Bb", "length")]
    assert body["usage"]["completion_tokens"] == 3
    texts = [c["text"] for c in completion_response(completion(n=2), deltas, done, "fp")["choices"]]
    assert texts == ["Aa", "Bb"]


def test_lone_surrogate_escapes_are_refused():
    with pytest.raises(InvalidRequest):
        parse_json_body(b'{"prompt": "\\ud94dx"}')
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001F600"


def test_response_format_becomes_a_constraint():
    assert chat(response_format={"type": "text"}).request.constraint is None
    assert chat(response_format={"type": "json_object"}).request.constraint.kind == "json_object"
    c = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}).request.constraint
    assert c.kind == "json_schema" and json.loads(c.schema_json)["properties"]["a"]["type"] == "integer"
    for bad in ("json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        assert chat_error(response_format=bad).param.startswith("response_format")


def test_llama_servers_grammar_and_json_schema_constrain_chat_too():
    assert chat(grammar='root ::= "yes" | "no"').request.constraint == Constraint("gbnf", 'root ::= "yes" | "no"')
    c = chat(json_schema={"type": "object"}).request.constraint
    assert c.kind == "json_schema" and json.loads(c.schema_json) == {"type": "object"}
    assert chat(grammar='root ::= "a"', response_format={"type": "text"}).request.constraint.kind == "gbnf"
    assert chat_error(grammar='root ::= "a"', json_schema={"type": "object"}).param == "json_schema"
    assert chat_error(grammar='root ::= "a"', response_format={"type": "json_object"}).param == "grammar"
    assert chat_error(grammar=3).param == "grammar" and chat_error(json_schema="x").param == "json_schema"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_tools_and_tool_choice():
    r = chat(tools=[WEATHER]).request
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto" and r.parallel_tool_calls
    assert chat(tools=[WEATHER], tool_choice="required").request.tool_choice == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER], tool_choice=named, parallel_tool_calls=False).request.tool_choice == "get_weather"
    assert chat_error(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}).param == "tool_choice"
    assert chat_error(tools=[WEATHER], tool_choice="sometimes").param == "tool_choice"
    assert chat_error(tool_choice="required").param == "tool_choice"
    assert chat_error(tools=[{"type": "function", "function": {"name": "bad name!"}}]).param == "tools[0].function.name"
    assert chat_error(tools=[WEATHER, WEATHER]).param == "tools[1]"
    assert chat_error(tools=[{"type": "retrieval"}]).param == "tools[0]"
    assert chat_error(tools=[WEATHER], tool_choice="required",
                      response_format={"type": "json_object"}).param == "tool_choice"


def test_tool_round_trip_messages():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    m = chat(messages=msgs, tools=[WEATHER]).request.messages
    assert m[1].tool_calls[0].name == "get_weather" and json.loads(m[1].tool_calls[0].arguments) == {"city": "Paris"}
    assert m[2].role == "tool" and m[2].tool_call_id == "call_1"


def test_streamed_tool_call_chunks_have_the_openai_shape():
    """A call's parts as they stream: the head (id, type, name), then its arguments' text in the
    pieces the model wrote; the delta that completes the call adds no chunk of its own."""
    from appliance.engine.types import ToolCall, ToolCallPart

    p = chat(stream=True, tools=[WEATHER])
    w = ChunkWriter(p, chat=True, fingerprint="fp")
    out = w.delta(Delta("id-1", "", (), call_parts=(ToolCallPart(0, "call_x", "get_weather"),
                                                    ToolCallPart(0, arguments='{"city": '))))
    out += w.delta(Delta("id-1", "", (), call_parts=(ToolCallPart(0, arguments='"Paris"}'),)))
    out += w.delta(Delta("id-1", "", (), tool_calls=(ToolCall("call_x", "get_weather", '{"city": "Paris"}'),)))
    first, second, third = (json.loads(part[6:]) for part in out.split(b"\n\n") if part)
    head = first["choices"][0]["delta"]["tool_calls"][0]
    assert head == {"index": 0, "id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert second["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert third["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": '"Paris"}'}}


# -- /tokenize and /detokenize -------------------------------------------------------------------

def test_tokenize_body_defaults_as_llama_server():
    assert parse_tokenize({"content": "hi"}) == ("hi", False, True, False)
    assert parse_tokenize({"content": "", "add_special": True, "parse_special": None,
                           "with_pieces": True}) == ("", True, True, True)
    for bad in ({}, {"content": None}, {"content": 3}, {"content": "hi", "add_special": 1}):
        with pytest.raises(InvalidRequest):
            parse_tokenize(bad)


def test_detokenize_body_is_a_list_of_ints():
    assert parse_detokenize({"tokens": [1, 2]}) == (1, 2) and parse_detokenize({"tokens": []}) == ()
    for bad in ({}, {"tokens": "1"}, {"tokens": [1.0]}, {"tokens": [True]}):
        with pytest.raises(InvalidRequest) as ei:
            parse_detokenize(bad)
        assert ei.value.param == "tokens"


def test_pieces_that_are_not_utf8_come_as_bytes():
    ev = Tokenized("tok-1", (5, 6, 7), (b"a", b"\xe6\x97", b"\xa5"))
    assert tokenize_response(ev, False) == {"tokens": [5, 6, 7]}
    assert tokenize_response(ev, True) == {"tokens": [{"id": 5, "piece": "a"}, {"id": 6, "piece": [230, 151]},
                                                      {"id": 7, "piece": [165]}]}


def test_cache_flags_are_booleans_with_llama_server_defaults():
    p = parse_chat({"messages": USER}, "r", SERVED, N_CTX)
    assert p.request.cache_prompt is True and p.request.cache_pin is False
    assert chat(cache_pin=True, cache_prompt=False).request.cache_pin is True
    assert parse_completion({"prompt": "x", "cache_pin": True}, "r", SERVED, N_CTX).request.cache_pin is True
    assert chat_error(cache_pin="yes").param == "cache_pin"


@pytest.mark.parametrize("mode", ["off", "lookup", "draft", None])
def test_speculate_takes_the_modes_and_refuses_others(mode):
    assert chat(speculate=mode).request.speculate == mode
    assert completion(speculate=mode).request.speculate == mode
    err = chat_error(speculate="medusa")
    assert err.param == "speculate" and "off, lookup, draft" in err.message


# -- continuing the final message (assistant prefill) --------------------------------------------
PREFILL = USER + [{"role": "assistant", "content": "Hello, I am"}]


def test_a_final_assistant_message_is_continued_by_default():
    req = chat(messages=PREFILL).request
    assert req.continue_final and not req.add_generation_prompt
    req = chat().request
    assert not req.continue_final and req.add_generation_prompt


def test_continuation_can_be_turned_off_or_asked_for_explicitly():
    req = chat(messages=PREFILL, continue_final_message=False).request
    assert not req.continue_final and req.add_generation_prompt
    req = chat(messages=PREFILL, add_generation_prompt=True).request
    assert not req.continue_final and req.add_generation_prompt
    assert chat(messages=PREFILL, continue_final_message=True, add_generation_prompt=False).request.continue_final


@pytest.mark.parametrize("body,param", [
    (dict(continue_final_message=True), "continue_final_message"),                     # last is the user's
    (dict(messages=PREFILL, continue_final_message=True, add_generation_prompt=True), "continue_final_message"),
    (dict(continue_final_message="yes"), "continue_final_message"),
    (dict(add_generation_prompt=1), "add_generation_prompt"),
])
def test_bad_continuation_is_refused_by_name(body, param):
    assert chat_error(**body).param == param
