"""LoRA adapters through the web app: llama-server's /lora-adapters and a request's `lora` on
llama-server's and OpenAI's routes, over a tiny model and two tiny adapters."""
from __future__ import annotations

import pytest
import requests

from tests.engine.gguf_fixtures import write_tiny
from tests.engine.lora_fixture import write_tiny_lora

from .conftest import running_server

PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-web")
    base = write_tiny(d / "base.gguf", "llama")
    a, b = write_tiny_lora(d / "a.gguf", base, seed=1), write_tiny_lora(d / "b.gguf", base, seed=2)
    with running_server(d, "--model", str(base), "--n-ctx", "256", "--n-slots", "2", "--lora", str(a),
                        "--lora-scaled", f"{b}:0.5", "--lora-init-without-apply", "--speculate", "off") as s:
        yield s, str(a), str(b)


def complete(url: str, **extra) -> requests.Response:
    return requests.post(url + "/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                    "cache_prompt": False, **extra}, timeout=60)


def chat(url: str, **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0, **extra}, timeout=60)


def test_get_and_post_lora_adapters(server):
    s, a, b = server
    assert requests.get(s.url + "/lora-adapters").json() == [{"id": 0, "path": a, "scale": 0.0},
                                                             {"id": 1, "path": b, "scale": 0.0}]
    base = complete(s.url).json()["content"]
    r = requests.post(s.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}])
    assert r.status_code == 200, r.text
    assert requests.get(s.url + "/lora-adapters").json()[0]["scale"] == 1.0
    assert requests.get(s.url + "/lora-adapters").json()[1]["scale"] == 0.0
    assert complete(s.url).json()["content"] != base
    assert requests.post(s.url + "/lora-adapters", json=[]).status_code == 200   # all at 0 again
    assert complete(s.url).json()["content"] == base


def test_a_requests_lora_changes_its_reply_only(server):
    s, _, _ = server
    base, under = complete(s.url).json()["content"], complete(s.url, lora=[{"id": 0, "scale": 1.0}]).json()["content"]
    assert under != base
    assert complete(s.url).json()["content"] == base
    chat_base = chat(s.url).json()["choices"][0]["message"]["content"]
    chat_under = chat(s.url, lora=[{"id": 0, "scale": 1.0}]).json()["choices"][0]["message"]["content"]
    assert chat_under != chat_base


@pytest.mark.parametrize("lora, field", [([{"id": 7, "scale": 1.0}], "lora[0].id"),
                                         ([{"id": 0, "scale": "big"}], "lora[0].scale"),
                                         ({"id": 0}, "lora")])
def test_bad_ids_and_scales_are_400s_naming_the_field(server, lora, field):
    s, _, _ = server
    for r in (complete(s.url, lora=lora), chat(s.url, lora=lora)):
        assert r.status_code == 400, r.text
        assert field in r.text
    r = requests.post(s.url + "/lora-adapters", json=[{"id": 5, "scale": 1.0}])
    assert r.status_code == 400 and "body[0].id" in r.text
