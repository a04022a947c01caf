"""Reasoning separation end to end, on a tiny random-weight model whose template opens a
<think> block in the generation prompt (as Qwen3's does) unless thinking is turned off."""
from __future__ import annotations

import json

import pytest
import requests

from ..engine.gguf_fixtures import write_tiny_llama
from .conftest import running_server

THINKING_TEMPLATE = (
    "{{ 'Today: ' + date_string + '\\n' }}"    # what llama-server gives every template: today's date
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
BODY = {"model": "tiny-thinker", "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "max_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-thinker.gguf", chat_template=THINKING_TEMPLATE)
    with running_server(tmp_path_factory.mktemp("srv"), "--model", str(model), "--n-ctx", "256",
                        "--n-slots", "1", timeout=120) as srv:
        yield srv


def test_apply_template_renders_todays_date_and_the_thinking_switch(server):
    from datetime import datetime

    def prompt(**kw) -> str:
        body = {"messages": BODY["messages"], **kw}
        return requests.post(server.url + "/apply-template", json=body, timeout=60).json()["prompt"]

    on = prompt()
    assert on.startswith(f"Today: {datetime.now().strftime('%d %b %Y')}\n") and on.endswith("assistant\n<think>\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")


def test_thinking_goes_to_reasoning_content(server):
    msg = requests.post(server.url + "/v1/chat/completions", json=BODY, timeout=60).json()["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] == ""


def test_streamed_reasoning_deltas(server):
    reasoning, content = "", ""
    with requests.post(server.url + "/v1/chat/completions", json={**BODY, "stream": True}, stream=True,
                       timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    full = requests.post(server.url + "/v1/chat/completions", json=BODY, timeout=60).json()
    assert reasoning == full["choices"][0]["message"]["reasoning_content"] and content == ""


def test_thinking_turned_off_through_the_template(server):
    body = {**BODY, "chat_template_kwargs": {"enable_thinking": False}}
    msg = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"]


def test_anthropic_thinking_blocks(server):
    """Anthropic's `thinking` is the template's switch; the reasoning comes back as a thinking
    block before the text, streamed as thinking_delta events."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    ask = dict(model="tiny-thinker", max_tokens=12, messages=BODY["messages"], extra_body={"temperature": 0})
    on = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **ask)
    assert on.content[0].type == "thinking" and on.content[0].thinking
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **ask) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and final.content[0].thinking == on.content[0].thinking
    off = client.messages.create(thinking={"type": "disabled"}, **ask)
    assert all(b.type == "text" for b in off.content)


def test_responses_reasoning_items(server):
    """The Responses API's reasoning.effort is the template's switch; the thinking comes back as a
    reasoning item (its text as reasoning_text content) before any message, streamed as
    reasoning_text deltas."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model="tiny-thinker", input=BODY["messages"][0]["content"], max_output_tokens=12, temperature=0,
               extra_body={"ignore_eos": True})
    on = client.responses.create(reasoning={"effort": "high"}, **ask)
    assert on.output[0].type == "reasoning" and on.output[0].content[0].type == "reasoning_text"
    assert on.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(reasoning={"effort": "high"}, stream=True, **ask))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == on.output[0].content[0].text == events[-1].response.output[0].content[0].text
    off = client.responses.create(reasoning={"effort": "none"}, **ask)
    assert [o.type for o in off.output] == ["message"] and off.output_text
