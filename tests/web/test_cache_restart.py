"""The prompt cache's disk tier across a server restart: a conversation's saved prefix is
restored and gives exactly the cold answer. The restart also reads its start-up probes back
(--probe-cache, which the suite sets for every server) and decides what the first start did."""
from __future__ import annotations

import pytest
import requests

from ..engine.runner_kinds import KINDS
from .conftest import running_server

STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 30


def ask(srv, messages, cache=True):
    r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 5,
        "cache_prompt": cache})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", KINDS)
def test_restart_restores_from_disk_exactly(tmp_path, kind):
    cache_dir = str(tmp_path / "kv")
    args = ("--engine", kind, "--n-ctx", "1024", "--n-slots", "1", "--prefill-chunk", "128", "--cache-dir", cache_dir)
    first = [{"role": "user", "content": STORY}]
    with running_server(tmp_path, *args) as srv:
        ask(srv, first)
        decided = srv.health()["settings"]
    # SIGTERM: the idle slot's kept blocks were written to disk
    assert list((tmp_path / "kv").glob("*.kv"))
    follow = first + [{"role": "assistant", "content": "He lit the lamp."},
                      {"role": "user", "content": "What happened on the stormy night?"}]
    with running_server(tmp_path, *args) as srv:
        warm = ask(srv, follow)
        cold = ask(srv, follow, cache=False)
        health = srv.health()["engine"]
        again = srv.health()["settings"]
        log = srv.log()
    assert "chunk-invariance: remembered" in log
    assert again["prompt_cache_reuse"] == decided["prompt_cache_reuse"]
    assert again["speculation"] == decided["speculation"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    assert health["disk_hits"] == 1 and health["disk_entries"] >= 1
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert warm["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == \
        cold["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
