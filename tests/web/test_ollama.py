"""Ollama's API without a server: requests translated to the OpenAI ones (end to end with the
`ollama` client: test_apis_e2e.py)."""
from __future__ import annotations

import pytest

from appliance.engine.types import Done, Timings, Usage
from appliance.errors import InvalidRequest
from web import ollama as O

M = "smollm2"


def test_chat_options_format_think_and_keep_alive():
    out = O.chat_body({"messages": [{"role": "user", "content": "hi"}], "format": "json", "think": False,
                       "keep_alive": "5m", "options": {"temperature": 0, "num_predict": 12, "seed": 3, "stop": ["x"],
                                                       "num_ctx": 4096, "top_k": 5}}, M)
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    assert (out["temperature"], out["max_tokens"], out["seed"], out["stop"], out["top_k"]) == (0, 12, 3, ["x"], 5)
    assert "num_ctx" not in out                      # the runner's options are accepted, without effect
    assert out["response_format"] == {"type": "json_object"} and out["chat_template_kwargs"] == {"enable_thinking": False}
    assert out["keep_alive"] == "5m" and out["stream"] is True and out["stream_options"] == {"include_usage": True}
    schema = {"type": "object"}
    assert O.chat_body({"messages": [], "format": schema, "stream": False}, M)["response_format"]["json_schema"]["schema"] == schema
    assert "max_tokens" not in O.chat_body({"messages": [], "options": {"num_predict": -1}}, M)


def test_ollamas_sampler_options_reach_the_engines_samplers():
    from web.sampling import sampling_params
    out = O.chat_body({"messages": [], "options": {"typical_p": 0.8, "mirostat": 2, "mirostat_tau": 4.0,
                                                    "mirostat_eta": 0.2, "repeat_last_n": 32}}, M)
    p = sampling_params(out, 4096)
    assert (p.typical_p, p.mirostat, p.mirostat_tau, p.mirostat_eta, p.penalty_last_n) == (0.8, 2, 4.0, 0.2, 32)


def test_tool_calls_get_ids_and_results_answer_them_in_order():
    out = O.chat_body({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}},
                                                           {"function": {"name": "w", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"}]}, M)
    calls = out["messages"][1]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_1", "call_2"] and calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert [m["tool_call_id"] for m in out["messages"][2:]] == ["call_1", "call_2"]


def test_generate_is_a_chat_turn_unless_raw():
    out = O.generate_body({"prompt": "Why?", "system": "Be brief.", "stream": False}, M)
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    raw = O.generate_body({"prompt": "Once upon", "raw": True, "think": True}, M)
    assert raw["prompt"] == "Once upon" and "messages" not in raw and "chat_template_kwargs" not in raw


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": "hi"}, "messages"), ({"messages": [], "options": {"warp": 9}}, "options.warp"),
    ({"messages": [], "format": "yaml"}, "format"), ({"messages": [], "stream": "no"}, "stream"),
    ({"messages": [{"role": "user", "content": "x", "images": "aGk="}]}, "messages[0].images"),
])
def test_bad_chat_requests_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequest) as ei:
        O.chat_body(body, M)
    assert ei.value.param == param


@pytest.mark.parametrize("field", ["suffix", "context"])
def test_generate_refuses_what_it_cannot_do(field):
    with pytest.raises(InvalidRequest) as ei:
        O.generate_body({"prompt": "x", field: ["y"] if field != "suffix" else "y"}, M)
    assert ei.value.param == field


def test_generate_images_are_openai_image_parts_before_the_text():
    content = O.generate_body({"prompt": "x", "images": ["aGk="]}, M)["messages"][-1]["content"]
    assert content == [{"type": "image_url", "image_url": {"url": "data:image/*;base64,aGk="}},
                       {"type": "text", "text": "x"}]
    raw = O.generate_body({"prompt": "x", "images": ["aGk="], "raw": True}, M)["prompt"]
    assert raw == {"prompt_string": "<__media__>x", "multimodal_data": ["aGk="]}
    with pytest.raises(InvalidRequest) as ei:
        O.generate_body({"prompt": "x", "images": "aGk="}, M)
    assert ei.value.param == "images"


def test_durations_are_nanoseconds_and_counts_the_usage():
    done = Done("r", "length", Usage(10, 5, 2), Timings(8, 2, 40.0, 4, 100.0, 1.0, 256))
    s = O._stats(done)
    assert s["done"] and s["done_reason"] == "length" and s["eval_count"] == 5 and s["prompt_eval_count"] == 10
    assert s["prompt_eval_duration"] == 40_000_000 and s["eval_duration"] == 100_000_000
    assert s["total_duration"] == 141_000_000
