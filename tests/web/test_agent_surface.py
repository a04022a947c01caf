"""What the coding agents need of the server beyond the translation (test_agents_e2e.py runs the
agents themselves): Anthropic's max_tokens as a ceiling at a small context, Ollama's version
for Codex's --oss mode, and the Responses API's namespace calls through the whole app."""
from __future__ import annotations

import json

import pytest

from .scripted_engine import ScriptedEngine, app_for, model

USER = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("surface"))


def test_anthropic_max_tokens_is_a_ceiling_the_context_ends_first(tmp):
    """Claude Code asks for 32000 tokens whatever the model: at a context of 2048 the reply runs
    to the context's end (stop_reason max_tokens), where OpenAI's chat route refuses by name."""
    engine = ScriptedEngine(model("Qwen3-Coder", tmp), n_ctx=2048)
    engine.reply = " one" * 2500
    client = app_for(engine, tmp, "ceiling").test_client()
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 32000, "messages": USER})
    assert r.status_code == 200, r.get_json()
    out = r.get_json()
    assert out["stop_reason"] == "max_tokens"
    assert out["usage"]["input_tokens"] + out["usage"]["output_tokens"] == 2048
    engine.reply = "Done."
    out = client.post("/v1/messages", json={"model": "m", "max_tokens": 32000, "messages": USER}).get_json()
    assert (out["stop_reason"], out["content"]) == ("end_turn", [{"type": "text", "text": "Done."}])
    engine.reply = " one" * 10
    small = client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": USER}).get_json()
    assert small["stop_reason"] == "max_tokens" and small["usage"]["output_tokens"] == 3
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 32000, "messages": USER})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "max_tokens"
    # Ollama's num_predict is a ceiling too, as Ollama's own
    engine.reply = " one" * 2500
    out = client.post("/api/chat", json={"model": "m", "messages": USER, "stream": False,
                                         "options": {"num_predict": 32000}}).get_json()
    assert out["done_reason"] == "length" and out["prompt_eval_count"] + out["eval_count"] == 2048


def test_ollama_version_is_the_api_codex_needs_and_the_appliances_own_beside_it(tmp):
    from appliance import __version__

    engine = ScriptedEngine(model("Qwen3-Coder", tmp))
    out = app_for(engine, tmp, "version").test_client().get("/api/version").get_json()
    assert out["appliance"] == __version__
    assert tuple(int(x) for x in out["version"].split(".")) >= (0, 13, 4)   # Codex --oss refuses older


def test_a_namespace_call_through_the_app_streamed_and_whole(tmp):
    """gpt-oss calls a function of a namespace under its flat name; the Responses API answers
    it as Codex reads it (`name` and `namespace`), whole and streamed, and echoes only the
    tools the model was offered."""
    engine = ScriptedEngine(model("openai-gpt-oss-120b", tmp))
    engine.reply = (" to=functions.agents__close_agent<|channel|>commentary json<|message|>"
                    '{"target": "a1"}')
    client = app_for(engine, tmp, "namespace").test_client()
    ns = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "parameters": {
              "type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}]}
    body = {"model": "m", "input": "Close a1.", "tools": [ns, {"type": "web_search"}]}
    out = client.post("/v1/responses", json=body).get_json()
    call = next(o for o in out["output"] if o["type"] == "function_call")
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("close_agent", "agents", {"target": "a1"})
    assert out["tools"] == [ns]
    text = client.post("/v1/responses", json={**body, "stream": True}).get_data(as_text=True)
    done = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    item = next(e["item"] for e in done if e["type"] == "response.output_item.done"
                and e["item"]["type"] == "function_call")
    assert (item["name"], item["namespace"]) == ("close_agent", "agents")
