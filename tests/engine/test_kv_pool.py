"""Slots that share one KV pool (--kv-unified, sched/kv_pool.py) with a fake runner whose forward
fails past the pool as llama_decode would: a request may fill the pool, admission waits for
cells, idle slots' cached prompts give theirs up, a request without max_tokens grows while
cells are free and ends with "length" when none are."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from appliance.config import EngineConfig
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Done, Error, Request, SamplingParams

from ..web.conftest import running_server
from .fake_runner import FakeRunner
from .gguf_fixtures import write_tiny_llama
from .test_scheduler import of, run


def make(n_slots=2, n_ctx=64, **cfg):
    runner = FakeRunner(n_slots=n_slots, n_ctx=n_ctx, unified=True)
    events = []
    cfg = {"prefill_chunk": 8, "step_token_budget": 8, **cfg}
    sched = Scheduler(runner, EngineConfig(n_slots=n_slots, n_ctx=n_ctx, **cfg), events.append)
    return sched, runner, events


def req(rid, max_tokens=None, **kw):
    return Request(id=rid, params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw),
                   prompt="x")


def test_one_request_may_fill_the_whole_pool():
    sched, runner, events = make(n_slots=4, n_ctx=64)
    sched.submit(req("a"), list(range(1, 41)))     # 40 of 64: more than a quarter, a split slot's share
    run(sched)
    done = of(events, "a", Done)[0]
    assert done.finish_reason == "length" and done.usage.completion_tokens == 24   # to the pool's end
    assert sched.stats().kv_capacity == 64


def test_a_request_waits_for_cells_that_running_ones_hold():
    sched, runner, events = make(n_slots=2, n_ctx=64)
    sched.submit(req("a", max_tokens=10), list(range(1, 31)))   # holds 40
    sched.submit(req("b", max_tokens=10), list(range(1, 21)))   # needs 30: 24 free
    sched.step()
    assert [a.req.id for a in sched.waiting] == ["b"] and sched.slots[1] is None
    run(sched)
    for rid, n in (("a", 10), ("b", 10)):
        done = of(events, rid, Done)[0]
        assert done.finish_reason == "length" and done.usage.completion_tokens == n
    assert of(events, "b", Done)[0].timings.queue_ms > 0


def test_a_request_that_must_wait_anyway_leaves_the_cached_prompts_alone():
    sched, runner, events = make(n_slots=3, n_ctx=64)
    sched.submit(req("c", max_tokens=2), list(range(1, 11)))
    run(sched)
    sched.submit(req("a", max_tokens=10), list(range(20, 50)))  # holds 40 (the cache's 12 cells fit beside it)
    sched.submit(req("b", max_tokens=10), list(range(1, 21)))   # needs 30: 24 free without the cache
    sched.step()
    assert [x.req.id for x in sched.waiting] == ["b"] and sched.cache.evicted == 0
    run(sched)
    assert of(events, "b", Done)[0].usage.completion_tokens == 10


def test_idle_slots_give_their_cached_prompts_to_a_request_that_needs_the_cells():
    sched, runner, events = make(n_slots=2, n_ctx=64)
    first = list(range(1, 41))
    sched.submit(req("a", max_tokens=2), first)
    run(sched)
    assert runner.kv_used(0) >= 40                  # kept for the next turn
    sched.submit(req("b", max_tokens=4), list(range(50, 80)))   # 34 cells: the cached prompt must go
    run(sched)
    assert of(events, "b", Done)[0].usage.completion_tokens == 4
    assert sched.cache.evicted == 1 and sched.cache.kept[0] == []


def test_the_next_turn_keeps_its_own_prefix_when_other_slots_are_evicted():
    sched, runner, events = make(n_slots=3, n_ctx=64)
    sched.submit(req("other", max_tokens=2), list(range(30, 50)))   # 20 tokens, then idle in its slot
    run(sched)
    turn1 = list(range(1, 25))
    sched.submit(req("t1", max_tokens=2), turn1)
    run(sched)
    turn2 = turn1 + [5, 6] + list(range(7, 30))      # 49 tokens: shares turn 1's 24
    sched.submit(req("t2", max_tokens=4), turn2)
    run(sched)
    done = of(events, "t2", Done)[0]
    assert done.usage.cached_tokens == 24 and done.usage.completion_tokens == 4
    assert sched.cache.evicted == 1 and sched.cache.kept[0] == []   # the other conversation gave way


def test_growing_requests_share_what_is_free_and_end_with_length_when_it_runs_out():
    sched, runner, events = make(n_slots=2, n_ctx=64)
    sched.submit(req("a"), list(range(1, 21)))
    sched.submit(req("b"), list(range(1, 21)))
    run(sched)
    da, db = of(events, "a", Done)[0], of(events, "b", Done)[0]
    assert da.finish_reason == db.finish_reason == "length"
    # 64 cells: 40 of prompts, 24 for both replies while both run (each last token is sampled,
    # never computed); b ran out first (a started a few steps earlier), and then a grew into
    # b's cells, which b's slot kept for the prompt cache until a needed them
    assert db.usage.completion_tokens >= 8 and da.usage.completion_tokens == 64 - 20
    assert sched.cache.evicted == 1
    for done in (da, db):   # the fake model counts up from the prompt's last token, none skipped
        assert list(done.token_ids) == [(20 + k) % 64 for k in range(1, done.usage.completion_tokens + 1)]


def test_a_request_over_the_pool_is_refused_with_the_pool_in_the_message():
    sched, runner, events = make(n_slots=2, n_ctx=64)
    sched.submit(req("a", max_tokens=30), list(range(1, 41)))
    (err,) = of(events, "a")
    assert isinstance(err, Error) and err.kind == "ContextOverflow"
    assert "the context of 64 tokens of the shared pool" in err.message


def test_choices_hold_the_pool_each():
    sched, runner, events = make(n_slots=3, n_ctx=64)
    sched.submit(Request(id="n", n=2, params=SamplingParams(temperature=0.0, max_tokens=6), prompt="x"),
                 list(range(1, 21)))
    sched.submit(req("c", max_tokens=10), list(range(1, 11)))   # 2 x 26 = 52 held: 12 free, needs 20
    sched.step()
    assert [a.req.id for a in sched.waiting] == ["c"]
    run(sched)
    assert of(events, "n", Done)[0].usage.completion_tokens == 12
    assert of(events, "c", Done)[0].usage.completion_tokens == 10


# -- llama.cpp's kv_unified through a server: its cells are the scheduler's ----------------------------

@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unified")
    model = write_tiny_llama(tmp / "tiny.gguf", n_ctx=2048, n_embd=128)   # heads of 32: q8_0 blocks
    with running_server(tmp, "--model", str(model), "--n-ctx", "1024", "--n-slots", "2", "--kv-unified", "--kv-type", "q8_0",
                        "--cache-disk-bytes", "0") as s:
        yield s


def _complete(server, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(start, n):
    return [1000 + (start + 7 * i) % 20000 for i in range(n)]


def test_llamacpp_serves_one_pool_and_says_so(unified):
    health = requests.get(unified.url + "/health", timeout=10).json()
    settings = health["settings"] if "settings" in health else health["models"][0]["settings"]
    assert settings["kv_unified"] is True
    assert settings["context"].startswith("1,024 positions in the pool the slots share")
    assert health["kv_bytes"] == 1024 * 2 * 2 * (32 + 32) * 34 // 32   # one pool: 2 layers x 2 KV heads, q8_0


def test_speculation_is_not_promised_exact_in_a_shared_pool():
    from appliance.engine.startup import speculation

    shared = speculation(EngineConfig(n_slots=2, n_ctx=4096, kv_unified=True), FakeRunner(n_slots=2, unified=True))
    assert shared.policy.default == "off" and "(--kv-unified)" in shared.policy.reason
    allowed = speculation(EngineConfig(n_slots=2, n_ctx=4096, kv_unified=True, speculate_inexact=True),
                          FakeRunner(n_slots=2, unified=True))
    assert allowed.policy.label("lookup") == "lookup-inexact"
    assert speculation(EngineConfig(n_slots=2, n_ctx=4096), FakeRunner(n_slots=2)).policy.default == "lookup"


def test_llamacpp_pool_waits_evicts_and_ends_growing_requests_at_its_end(unified):
    # two requests of 700 + 100 cannot run at once in 1,024 cells: the second waits, none fails
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda s: _complete(unified, _ids(s, 700), max_tokens=100), (0, 3))
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 100
    # both slots now keep ~800 cells between them: a prompt of 900 with no max_tokens evicts
    # them and grows to the pool's end
    c = requests.post(unified.url + "/completion", json={"prompt": _ids(11, 900), "n_predict": -1, "temperature": 0,
                                                         "ignore_eos": True}, timeout=120).json()
    assert c["stop_type"] == "limit" and c["tokens_predicted"] == 124
    # and the next turn of that conversation reuses its prefix from the slot it kept
    d = _complete(unified, _ids(11, 900)[:880] + _ids(50, 40), max_tokens=8)
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
