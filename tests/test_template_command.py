"""`appliance template render|parse`: the prompt the server builds for a chat request, and the
message it reads from a raw reply, for a GGUF (its own template) or a template file."""
from __future__ import annotations

import io
import json
import sys

import pytest

from appliance.cli import main
from tests.engine.chat_templates import cases
from tests.engine.gguf_fixtures import write_tiny

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}}}}}]
REQUEST = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def run(monkeypatch, capsys, argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["template", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def request_file(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST))
    return str(path)


def test_render_prints_the_prompt_with_the_templates_own_tool_declarations(monkeypatch, capsys, request_file):
    template = str(cases.HERE / "Qwen3-Coder.jinja")
    code, out, _ = run(monkeypatch, capsys, ["render", "--chat-template", template, "--request", request_file])
    assert code == 0
    assert "<function>\n<name>get_weather</name>" in out and out.endswith("<|im_start|>assistant\n")
    code, again, _ = run(monkeypatch, capsys, ["render", "--chat-template", template], stdin=json.dumps(REQUEST))
    assert code == 0 and again == out     # the request on stdin is the same request


def test_parse_types_the_arguments_by_the_tools_schema(monkeypatch, capsys, request_file):
    code, out, _ = run(monkeypatch, capsys, ["parse", "--chat-template", str(cases.HERE / "Qwen3-Coder.jinja"),
                                             "--request", request_file], stdin=QWEN3_CODER_CALL)
    msg = json.loads(out)
    assert code == 0 and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris", "days": 3})]


def test_parse_reads_gpt_oss_channels_into_reasoning_and_a_call(monkeypatch, capsys, request_file):
    reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
    code, out, _ = run(monkeypatch, capsys, ["parse", "--chat-template", str(cases.HERE / "openai-gpt-oss-120b.jinja"),
                                             "--request", request_file], stdin=reply)
    msg = json.loads(out)
    assert code == 0 and msg["reasoning_content"] == "Need the weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_gguf_brings_its_own_template(monkeypatch, capsys, tmp_path, request_file):
    path = write_tiny(tmp_path / "m.gguf", "llama", n_layer=1, n_embd=16, n_head=2, n_head_kv=1, n_ff=16,
                      chat_template=cases.template("Qwen3-Coder"))
    code, out, _ = run(monkeypatch, capsys, ["render", "--model", str(path), "--request", request_file])
    assert code == 0 and "<name>get_weather</name>" in out
    code, out, _ = run(monkeypatch, capsys, ["parse", "--model", str(path), "--request", request_file],
                       stdin=QWEN3_CODER_CALL)
    assert code == 0 and json.loads(out)["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_embedded_model_is_the_default_and_thinking_is_split_off(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, ["parse"], stdin="<think>Let me see.</think>Hello")
    assert code == 0 and json.loads(out) == {"role": "assistant", "content": "Hello", "reasoning_content": "Let me see."}


def test_mistakes_are_said_and_exit_2(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, ["render"], stdin="not json")
    assert code == 2 and "not JSON" in err
    code, _, err = run(monkeypatch, capsys, ["render", "--model", str(tmp_path / "none.gguf")], stdin="{}")
    assert code == 2 and "no such model file" in err
    code, _, err = run(monkeypatch, capsys, ["render"], stdin=json.dumps({"messages": []}))
    assert code == 2 and "messages" in err
