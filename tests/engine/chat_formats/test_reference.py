"""The chat layer as a whole against llama.cpp's: for every reply of the reference
(chat_templates/llama_chat.json: test-chat.cpp's cases and a generated corpus, for each of the 70
templates), the request renders through the engine's ChatLayer, the reply is read by the parser it
sets up from that prompt (forced-open thinking included), and the message, whole and streamed, is
the one llama.cpp's common_chat_parse returned.

Not compared, each for its reason (KNOWN): a continued final message (llama.cpp parses its
prefill with the reply; the API here returns what is generated after it), a request with a
json_schema (llama.cpp takes the JSON out of a ```json fence; here the schema constrains the
answer instead), a tool name the OpenAI API refuses (OpenAI's pattern, letters, digits, _ and -),
and a thinking-off prompt whose own text after </think> llama.cpp parses with the reply (SmolLM3).
A reply llama.cpp throws on loses nothing here: its text stays in the message; where llama.cpp
drops text it cannot read, it stays content here (reference.kept_what_llama_cpp_dropped).
"""
from __future__ import annotations

import json
import re

import pytest

from appliance.engine.chat_layer import ChatLayer
from appliance.engine.chat_formats.stream import ChatStream
from web.wire import parse_chat

from ..chat_templates import cases
from .reference import kept_what_llama_cpp_dropped

REFERENCE = cases.chat_reference()
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def known(c: dict) -> str | None:
    r = c["request"]
    if r["messages"][-1]["role"] == "assistant":
        return "a continuation: llama.cpp parses the prefill with the reply"
    if r.get("json_schema"):
        return "a response schema: llama.cpp unwraps a ```json fence"
    if any(not OPENAI_NAME.match(t["function"]["name"]) for t in r.get("tools") or []):
        return "a tool name outside OpenAI's pattern: the API refuses it by name"
    if r["template"] == "HuggingFaceTB-SmolLM3-3B" and r.get("enable_thinking") is False:
        return "the thinking-off prompt's own text after </think> is parsed with the reply by llama.cpp"
    return None


def compared() -> list[tuple[str, dict]]:
    return [(name, c) for name, t in sorted(REFERENCE.items()) for c in t["cases"]
            if not c.get("partial") and c.get("message") and known(c) is None]


CASES = compared()


def request(r: dict):
    body: dict = {"model": "m", "messages": r["messages"], "add_generation_prompt": r.get("add_generation_prompt", True)}
    if r.get("tools"):
        body.update(tools=r["tools"], tool_choice=r.get("tool_choice", "auto"),
                    parallel_tool_calls=r.get("parallel_tool_calls", True))
    if r.get("reasoning_format"):
        body["reasoning_format"] = r["reasoning_format"]
    kwargs = dict(r.get("kwargs") or {})
    if "enable_thinking" in r:
        kwargs.setdefault("enable_thinking", r["enable_thinking"])
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return parse_chat(body, "r", {"m"}, 1 << 30).request


def message(pieces) -> tuple[str, str, list]:
    content = "".join(p.content for p in pieces)
    reasoning = "".join(p.reasoning for p in pieces)
    calls = [(c.name, json.loads(c.arguments or "{}")) for p in pieces for c in p.calls]
    return content, reasoning, calls


def as_dict(m: tuple[str, str, list]) -> dict:
    return {"content": m[0], "reasoning_content": m[1], "tool_calls": m[2]}


def llama_cpp(msg: dict) -> tuple[str, str, list]:
    return (msg.get("content") or "", msg.get("reasoning_content") or "",
            [(c["name"], json.loads(c["arguments"] or "{}")) for c in msg.get("tool_calls") or []])


@pytest.fixture(scope="module")
def layers() -> dict[str, ChatLayer]:
    return {}


def layer_for(layers: dict, name: str, r: dict) -> ChatLayer:
    key = f"{name}|{r.get('bos', '')}|{r.get('eos', '')}"
    if key not in layers:
        layers[key] = ChatLayer(cases.template(name), r.get("bos", ""), r.get("eos", ""))
    return layers[key]


@pytest.mark.parametrize("template,case", CASES, ids=[f"{t}-{c['name']}" for t, c in CASES])
def test_the_message_is_llama_cpps(layers, template, case):
    r = case["request"]
    layer = layer_for(layers, template, r)
    req = request(r)
    prompt = layer.render(req)
    whole = layer.parser(req, prompt)
    got = message([whole.feed(case["reply"]), whole.flush()])
    if "error" in case["message"]:   # llama.cpp throws: nothing of the reply is lost here
        assert got[0] or got[2], got
        return
    want = llama_cpp(case["message"])
    assert got == want or kept_what_llama_cpp_dropped(as_dict(got), as_dict(want), case["reply"])
    fmt, ctx = layer.context(req, prompt)
    stream, reply = ChatStream(fmt, ctx), case["reply"]
    pieces = [stream.feed(reply[i:i + 5]) for i in range(0, len(reply), 5)] + [stream.flush()]
    assert message(pieces) == got
