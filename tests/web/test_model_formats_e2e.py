"""Replies in the models' own formats, end to end: a tiny GGUF carries a real model's chat
template and a vocabulary in which its format's markers are special tokens (llama.cpp's preserved
tokens for that template); a scripted runner writes a reply that llama.cpp's parser read
(chat_templates/llama_chat.json) token by token; the engine's prompt builder, scheduler,
detokenizer and output parser turn it into events; and every dialect gives the message llama.cpp
read: OpenAI chat (whole and streamed), the Responses API, Anthropic Messages and Ollama.

A forced tool choice runs the same script under the format's grammar, whose markers are the
vocabulary's special tokens: the call comes back only if the grammar let every token through.
"""
from __future__ import annotations

import json

import pytest

from . import scripted_engine
from .scripted_engine import REFERENCE, ScriptedEngine, model

# (template, generated case): one of each family the people this is for run
CASES = [("openai-gpt-oss-120b", "reasoning_then_call"), ("openai-gpt-oss-120b", "content_then_call"),
         ("Qwen3-Coder", "two_calls"), ("Qwen3.5-4B", "reasoning_then_call"), ("GLM-4.7-Flash", "reasoning_then_call"),
         ("MiniMax-M2", "nested_unicode_args"), ("deepseek-ai-DeepSeek-V3.1", "two_calls"),
         ("moonshotai-Kimi-K2", "two_calls"), ("google-gemma-4-31B-it", "reasoning_then_call"),
         ("google-gemma-4-31B-it", "plain"), ("LFM2-8B-A1B", "test-chat 6"), ("Qwen-Qwen2.5-7B-Instruct", "two_calls")]


def case(template: str, name: str) -> dict:
    """A recorded reply: a generated case of the template's, or one of test-chat.cpp's (LFM2's
    template writes no call in history for the generated ones)."""
    return next(c for c in REFERENCE[template]["cases"] if c["name"] == name)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("formats"))


def app_for(template: str, tmp: str, reply: str):
    engine = ScriptedEngine(model(template, tmp))
    engine.reply = reply
    return scripted_engine.app_for(engine, tmp, template), engine


def body_of(c: dict) -> dict:
    r = c["request"]
    body = {"model": "m", "messages": r["messages"], "max_tokens": 400, "temperature": 0}
    if r.get("tools"):
        body.update(tools=r["tools"], tool_choice=r.get("tool_choice", "auto"))
    kwargs = dict(r.get("kwargs") or {})
    if "enable_thinking" in r:
        kwargs.setdefault("enable_thinking", r["enable_thinking"])
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def want_of(c: dict) -> tuple[str, str, list]:
    m = c["message"]
    return (m["content"] or "", m["reasoning_content"] or "",
            [(t["name"], json.loads(t["arguments"] or "{}")) for t in m["tool_calls"]])


def openai_message(app, body: dict) -> tuple[str, str, list]:
    r = app.test_client().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.get_data(as_text=True)
    msg = r.get_json()["choices"][0]["message"]
    return (msg.get("content") or "", msg.get("reasoning_content") or "",
            [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg.get("tool_calls") or []])


def openai_streamed(app, body: dict) -> tuple[tuple[str, str, list], list[str]]:
    r = app.test_client().post("/v1/chat/completions", json={**body, "stream": True})
    content, reasoning, names, args = "", "", {}, {}
    finish = []
    for line in r.get_data(as_text=True).splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for t in delta.get("tool_calls") or []:
            if t.get("function", {}).get("name"):
                names[t["index"]] = t["function"]["name"]
            args[t["index"]] = args.get(t["index"], "") + (t.get("function", {}).get("arguments") or "")
        if choice.get("finish_reason"):
            finish.append(choice["finish_reason"])
    calls = [(names[i], json.loads(args[i] or "{}")) for i in sorted(names)]
    return (content, reasoning, calls), finish


@pytest.mark.parametrize("template,name", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_every_dialect_reads_the_models_own_format_as_llama_cpp(tmp, template, name):
    c = case(template, name)
    want = want_of(c)
    app, engine = app_for(template, tmp, c["reply"])
    body = body_of(c)
    assert openai_message(app, body) == want
    assert len(engine.tokens) < len(c["reply"]) / 1.5 or not want[2]   # markers went in as single tokens
    streamed, finish = openai_streamed(app, body)
    assert streamed == want and finish == ["tool_calls" if want[2] else "stop"]
    # the Responses API: reasoning, message and function_call items
    r = app.test_client().post("/v1/responses", json={"model": "m", "input": body["messages"],
                                                      **({"tools": [{"type": "function", **t["function"]} for t in
                                                                    body["tools"]]} if body.get("tools") else {}),
                                                      **({"reasoning": {"effort": "high"}} if want[1] else {})})
    out = r.get_json()["output"]
    calls = [(o["name"], json.loads(o["arguments"])) for o in out if o["type"] == "function_call"]
    text = "".join(p["text"] for o in out if o["type"] == "message" for p in o["content"])
    assert (calls, text) == (want[2], want[0]), out   # the whole output, should this ever differ
    # Anthropic: thinking, text and tool_use blocks
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"].get("parameters", {"type": "object"})} for t in body.get("tools") or []]
    r = app.test_client().post("/v1/messages", json={"model": "m", "max_tokens": 400, "messages": body["messages"],
                                                     **({"tools": tools} if tools else {})})
    blocks = r.get_json()["content"]
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == want[2]
    assert "".join(b["text"] for b in blocks if b["type"] == "text") == want[0]
    assert "".join(b["thinking"] for b in blocks if b["type"] == "thinking") == want[1]
    # Ollama: message.content, message.thinking, message.tool_calls
    r = app.test_client().post("/api/chat", json={"model": "m", "messages": body["messages"], "stream": False,
                                                  **({"tools": body["tools"]} if body.get("tools") else {})})
    msg = r.get_json()["message"]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []] == want[2]
    assert msg["content"] == want[0] and msg.get("thinking", "") == want[1]


FORCED = [("openai-gpt-oss-120b", "one_call"), ("Qwen3-Coder", "one_call"), ("GLM-4.7-Flash", "one_call"),
          ("MiniMax-M2", "one_call"), ("deepseek-ai-DeepSeek-V3.1", "one_call"), ("moonshotai-Kimi-K2", "one_call"),
          ("google-gemma-4-31B-it", "one_call"), ("Qwen-Qwen2.5-7B-Instruct", "one_call")]


@pytest.mark.parametrize("template,name", FORCED, ids=[f"{t}-{n}" for t, n in FORCED])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_choice_lets_the_models_own_call_through_its_grammar(tmp, template, name, choice):
    c = case(template, name)
    want = want_of(c)
    app, _ = app_for(template, tmp, c["reply"])
    body = body_of(c)
    body["tool_choice"] = "required" if choice == "required" else \
        {"type": "function", "function": {"name": want[2][0][0]}}
    assert openai_message(app, body)[2] == want[2]
    # every token of the script went through the grammar's mask (it ends the reply once complete)
    generated = app.extensions["appliance"].pool.engine.generated
    assert generated and generated == engine_script(app)[:len(generated)]


def engine_script(app) -> list[int]:
    return app.extensions["appliance"].pool.engine.tokens


def test_auto_holds_a_begun_call_to_the_offered_tools(tmp):
    """tool_choice auto: once the reply begins a call (Kimi's section marker, a special token),
    the format's grammar holds it: a model set on a tool the request did not offer is steered to
    one it did (llama.cpp's lazy grammar); text before any call runs free (every dialect test
    above replays its script under auto unchanged)."""
    c = case("moonshotai-Kimi-K2", "one_call")
    unknown = c["reply"].replace("get_weather", "launch_rockets")
    app, engine = app_for("moonshotai-Kimi-K2", tmp, unknown)
    body = body_of(c)
    r = app.test_client().post("/v1/chat/completions", json=body).get_json()["choices"][0]
    offered = {t["function"]["name"] for t in body["tools"]}
    assert r["message"]["tool_calls"] and {t["function"]["name"] for t in r["message"]["tool_calls"]} <= offered
    said = engine.runner.detokenize(engine.generated).decode()
    assert said.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.") and "launch" not in said


def test_bad_replies_lose_nothing(tmp):
    """A call cut off by max_tokens ends with finish_reason "length", its arguments closed as far
    as they came (a call of a tool not offered, which the parser keeps as content, is
    tests/engine/chat_formats/reference.py's: under auto the grammar no longer lets one through)."""
    c = case("Qwen-Qwen2.5-7B-Instruct", "nested_unicode_args")
    app, engine = app_for("Qwen-Qwen2.5-7B-Instruct", tmp, c["reply"])
    body = {**body_of(c), "max_tokens": 30}
    r = app.test_client().post("/v1/chat/completions", json=body).get_json()["choices"][0]
    assert r["finish_reason"] == "length" and r["message"]["content"] in (None, "")
    call = r["message"]["tool_calls"][0]["function"]
    assert call["name"] == "set_flags" and isinstance(json.loads(call["arguments"]), dict)
    streamed, finish = openai_streamed(app, body)
    assert finish == ["length"] and streamed[2] == [("set_flags", json.loads(call["arguments"]))]



def test_a_response_format_holds_gpt_oss_answer_not_its_reasoning(tmp):
    """response_format on gpt-oss: the analysis channel is free, the final channel is the JSON
    of the schema (llama.cpp's grammar for it); every scripted token goes through the mask."""
    reply = ('<|channel|>analysis<|message|>They want a number.<|end|><|start|>assistant<|channel|>final'
             '<|message|>{"n": 4}')
    app, engine = app_for("openai-gpt-oss-120b", tmp, reply)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    content, reasoning, calls = openai_message(app, body)
    assert (json.loads(content), reasoning, calls) == ({"n": 4}, "They want a number.", [])
    assert engine.generated == engine.tokens[:len(engine.generated)]


def test_a_response_format_holds_the_answer_after_a_thinking_block(tmp):
    """Qwen3.5's prompt opens <think>: the reasoning runs free to </think>, the answer is the JSON."""
    reply = 'They want a number.\n</think>\n\n{"n": 4}'
    app, engine = app_for("Qwen3.5-4B", tmp, reply)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    content, reasoning, _ = openai_message(app, body)
    assert (json.loads(content), reasoning) == ({"n": 4}, "They want a number.\n")   # llama.cpp keeps the newline
    assert engine.generated == engine.tokens[:len(engine.generated)]
