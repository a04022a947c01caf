"""--stream-interval-ms (issue 47): a stream's later tokens leave the engine gathered, at most
every interval while it keeps decoding; its first token, its end and errors go at once. Every
token is still its own event and SSE chunk: only the number of messages changes."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import requests

from appliance.config import EngineConfig
from appliance.engine.loop import EngineLoop
from appliance.engine.types import Delta

from ..web.conftest import running_server
from .gguf_fixtures import write_tiny_llama


def loop(interval_ms: int, outbox: list, streaming: set, sent_at: float, working: bool = True):
    return SimpleNamespace(cfg=EngineConfig(stream_interval_ms=interval_ms), outbox=outbox, _streaming=streaming,
                           _sent_at=sent_at, has_work=lambda: working)


def delta(rid: str) -> Delta:
    return Delta(rid, "x", (1,))


def test_only_a_streams_later_tokens_wait_and_never_past_the_interval():
    hold = EngineLoop._hold
    assert hold(loop(40, [delta("a")], {"a"}, sent_at=10.0), 10.02)              # a later token, 20 ms on
    assert not hold(loop(40, [delta("a")], {"a"}, sent_at=10.0), 10.05)          # the interval is up
    assert not hold(loop(40, [delta("a"), delta("b")], {"a"}, sent_at=10.0), 10.02)   # b's first token
    assert not hold(loop(40, [delta("a"), "a Done"], {"a"}, sent_at=10.0), 10.02)     # an end goes at once
    assert not hold(loop(40, [delta("a")], {"a"}, sent_at=10.0, working=False), 10.02)  # nothing follows
    assert not hold(loop(0, [delta("a")], {"a"}, sent_at=10.0), 10.001)          # 0: every step


def test_stats_due_while_tokens_are_held_wait_for_them_and_go_alone_otherwise():
    def due(outbox: list, stats_due: bool, now: float = 10.02) -> bool:
        ns = loop(40, outbox, {"a"}, sent_at=10.0)
        ns._hold = lambda t: EngineLoop._hold(ns, t)
        return EngineLoop._due(ns, now, stats_due)

    assert not due([delta("a")], stats_due=True)             # held tokens: the stats go with them
    assert due([delta("a")], stats_due=True, now=10.05)      # ... when the interval is up
    assert due([], stats_due=True)                           # nothing held (a prefill, idle): alone
    assert due([delta("b")], stats_due=False)                # a first token goes at once
    assert not due([], stats_due=False)                      # nothing to say


@pytest.fixture(scope="module", params=[0, 2000], ids=["every-step", "gathered"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interval")
    model = write_tiny_llama(tmp / "tiny.gguf")
    with running_server(tmp, "--model", str(model), "--n-ctx", "512", "--n-slots", "1",
                        "--stream-interval-ms", str(request.param)) as s:
        s.interval = request.param
        yield s


def test_a_stream_arrives_whole_its_first_token_alone_and_the_rest_gathered(server):
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    whole = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    arrivals, text = [], []
    with requests.post(server.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.monotonic())
                    text.append(chunk["choices"][0]["text"])
    assert "".join(text) == whole["choices"][0]["text"]
    assert len(arrivals) >= 40     # nearly every token its own chunk (a few pieces join into one character)
    # the whole reply decodes in well under 2 s: gathered, the first token comes alone and every
    # later one with the end; a message every step spreads them over the decode
    first_gap, rest = arrivals[1] - arrivals[0], arrivals[-1] - arrivals[1]
    assert (first_gap > rest) == (server.interval > 0), (first_gap, rest)
