"""`--prompt-cache fast` end to end with the official `openai` client: the next turn of a chat
reuses the previous prompt and the reply to the token, as llama-server does, and the response
says that it reused more than exact reuse would (timings.cache_reuse, /metrics); /health says
which mode runs and what the engine proved."""
from __future__ import annotations

import time

import openai
import pytest
import requests

from .conftest import running_server

STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("fast"), "--n-ctx", "1024", "--n-slots", "1",
                        "--prefill-chunk", "128", "--prompt-cache", "fast") as srv:
        yield srv


def test_health_says_fast_and_what_exact_reuse_would_be(server):
    settings = requests.get(server.url + "/health", timeout=10).json()["settings"]
    assert settings["prompt_cache"] == "fast"
    assert settings["prompt_cache_reuse"]["mode"] == "fast" and settings["prompt_cache_reuse"]["min_chunk"] == 2


def test_the_next_turn_reuses_the_reply_and_is_labelled_inexact(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    turn = [{"role": "user", "content": STORY + "What did he do every evening?"}]
    first = client.chat.completions.create(model=model, messages=turn, temperature=0, max_tokens=12)
    reply = first.choices[0].message.content
    assert first.model_extra["timings"]["cache_reuse"] == "exact"      # nothing was reused
    follow = turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=model, messages=follow, temperature=0, max_tokens=4)
    cached = again.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt and some of the reply came from the cache (the reply's last token
    # was never fed back, and the template closes the turn after it)
    assert first.usage.prompt_tokens < cached < first.usage.prompt_tokens + first.usage.completion_tokens
    assert again.model_extra["timings"]["cache_reuse"] == "inexact"
    # the engine sends its counters about ten times a second: a scrape may precede the latest
    deadline = time.monotonic() + 10
    while "appliance_prompt_cache_inexact_hits_total 1.0" not in (
            metrics := requests.get(server.url + "/metrics", timeout=10).text) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "appliance_prompt_cache_inexact_hits_total 1.0" in metrics
