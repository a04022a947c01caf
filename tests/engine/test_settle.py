"""Replies settled while idle (`PromptCache.settle_one`): a reply's tokens, computed by one-token
decode steps, are computed again as prompt chunks of at least m rows, so the next turn, which
resends the reply, reuses it exactly; on the real model that next turn gives the cold answer."""
from __future__ import annotations

import time

import pytest

from appliance.config import EngineConfig
from appliance.engine.cache.prompt_cache import SETTLE_ROWS, PromptCache
from appliance.engine.grid import Grid
from appliance.engine.loop import SETTLE_AFTER_S, EngineLoop
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Delta, Done, Request, SamplingParams

from .fake_runner import FakeRunner
from .test_grid_reuse import STORY, ShapedRunner, real  # noqa: F401  (real: the module's llama.cpp runner)
from .test_prefix_cache import greedy


def make(runner, mode="on", m=2, chunk=32, ram=0):
    cfg = EngineConfig(n_slots=runner.info.n_slots, n_ctx=runner.info.n_ctx, prefill_chunk=chunk,
                       step_token_budget=256, prompt_cache=mode, cache_ram_bytes=ram)
    events: list = []
    return Scheduler(runner, cfg, events.append, PromptCache.from_config(runner, cfg, grid=Grid(chunk, m))), events


def ask(sched, events, rid, prompt, max_tokens=6, cache=True, cancel_after=None):
    sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=max_tokens), prompt="x",
                         cache_prompt=cache), list(prompt))
    while sched.has_work():
        sched.step()
        if cancel_after is not None and sched.steps >= cancel_after:
            sched.abort(rid)
    reply = [t for e in events if isinstance(e, Delta) and e.request_id == rid for t in e.token_ids]
    return reply, [e for e in events if isinstance(e, Done) and e.request_id == rid][0]


def settle_all(cache) -> list[int]:
    pieces = []
    while n := cache.settle_one():
        pieces.append(n)
    return pieces


def test_a_settled_reply_is_reused_by_the_next_turn_computed_as_a_cold_run_computes_it():
    # a runner whose one-row chunks compute differently (llama.cpp's case): its marks say how
    # every position of the KV was computed
    runner = ShapedRunner(lambda rows: rows == 1)
    sched, events = make(runner)
    a = [1 + i % 30 for i in range(45)]
    reply, _ = ask(sched, events, "a", a, max_tokens=20)
    assert sched.cache.kept[0] == a and sched.cache.unsettled[0] == reply and sched.cache.settling
    assert sched.cache.stats().unsettled_tokens == 20         # /health's idle work left
    assert settle_all(sched.cache) == [SETTLE_ROWS] * (20 // SETTLE_ROWS) + [20 % SETTLE_ROWS] and not sched.cache.settling
    assert sched.cache.kept[0] == a + reply and sched.cache.exact[0] == len(a) + len(reply)
    assert sched.cache.stats().settled_tokens == 20 and sched.cache.stats().unsettled_tokens == 0
    follow = a + reply + [7, 8, 9]
    _, warm = ask(sched, events, "warm", follow, max_tokens=1)
    assert warm.usage.cached_tokens == len(a) + len(reply) and warm.timings.cache_reuse == "exact"
    warm_marks = list(runner.marks[0][:len(follow)])
    _, cold = ask(sched, events, "cold", follow, max_tokens=1, cache=False)
    assert cold.usage.cached_tokens == 0
    assert warm_marks == runner.marks[0][:len(follow)] and not any(warm_marks)  # no position from a 1-row chunk


def test_without_settling_the_reply_is_not_reused():
    runner = ShapedRunner(lambda rows: rows == 1)
    sched, events = make(runner)
    a = [1 + i % 30 for i in range(45)]
    reply, _ = ask(sched, events, "a", a, max_tokens=20)
    _, warm = ask(sched, events, "warm", a + reply + [7, 8, 9], max_tokens=1)
    # the slot was taken: only the new one-token reply is left to settle (with a kept position)
    assert warm.usage.cached_tokens == len(a) and sched.cache.unsettled[0] == list(warm.token_ids)


def test_pieces_are_never_shorter_than_m_rows():
    runner = FakeRunner(n_slots=1, n_ctx=512)
    sched, events = make(runner, m=4)
    reply, _ = ask(sched, events, "a", list(range(1, 30)), max_tokens=SETTLE_ROWS + 2)
    n = len(runner.calls)
    assert settle_all(sched.cache) == [SETTLE_ROWS - 2, 4]          # not SETTLE_ROWS then 2
    assert [(s.start_pos, len(s.tokens)) for c in runner.calls[n:] for s in c] == [(29, SETTLE_ROWS - 2), (27 + SETTLE_ROWS, 4)]
    assert runner.kv[0] == list(range(1, 30)) + reply


def test_a_reply_shorter_than_m_is_settled_with_the_kept_positions_before_it():
    # m = 16: a 6-token reply is computed in one 16-row chunk that starts 10 kept positions back
    runner = ShapedRunner(lambda rows: rows < 16)
    sched, events = make(runner, m=16)
    a = [1 + i % 30 for i in range(45)]
    reply, _ = ask(sched, events, "a", a, max_tokens=6)
    n = len(runner.calls)
    assert settle_all(sched.cache) == [6] and sched.cache.kept[0] == a + reply
    assert [(s.start_pos, len(s.tokens)) for c in runner.calls[n:] for s in c] == [(35, 16)]
    follow = a + reply + list(range(1, 20))
    _, warm = ask(sched, events, "warm", follow, max_tokens=1)
    assert warm.usage.cached_tokens == len(a) + len(reply)
    assert not any(runner.marks[0][:len(follow)])        # every position from a chunk of 16 or more


def test_a_request_arriving_while_a_reply_settles_takes_what_is_settled():
    runner = FakeRunner(n_slots=1, n_ctx=512)
    sched, events = make(runner)
    a = list(range(1, 30))
    reply, _ = ask(sched, events, "a", a, max_tokens=30)
    assert sched.cache.settle_one() == SETTLE_ROWS
    _, warm = ask(sched, events, "b", a + reply + [5, 5], max_tokens=1)
    assert warm.usage.cached_tokens == len(a) + SETTLE_ROWS and sched.cache.unsettled[0] == list(warm.token_ids)


def test_a_settling_slot_left_idle_keeps_its_reply_while_another_slot_serves():
    runner = FakeRunner(n_slots=2, n_ctx=512)
    sched, events = make(runner)
    a = list(range(1, 30))
    reply, _ = ask(sched, events, "a", a, max_tokens=30)
    ask(sched, events, "other", [40] * 20, max_tokens=2)       # takes the free slot, not a's
    settle_all(sched.cache)
    _, warm = ask(sched, events, "b", a + reply + [5, 5], max_tokens=1)
    assert warm.usage.cached_tokens == len(a) + len(reply)


@pytest.mark.parametrize("mode, m, cancel", [("on", 0, False), ("fast", 2, False), ("on", 2, True), ("off", 2, False)])
def test_nothing_is_settled_on_grid_reuse_in_fast_or_off_mode_or_for_a_cancelled_request(mode, m, cancel):
    runner = FakeRunner(n_slots=1, n_ctx=512)
    sched, events = make(runner, mode=mode, m=m)
    ask(sched, events, "a", list(range(1, 30)), max_tokens=20, cancel_after=3 if cancel else None)
    assert not sched.cache.settling and sched.cache.settle_one() == 0


def test_a_runner_failure_while_settling_drops_that_reply_and_keeps_the_prompt():
    runner = FakeRunner(n_slots=1, n_ctx=512)
    sched, events = make(runner)
    a = list(range(1, 30))
    ask(sched, events, "a", a, max_tokens=30)
    assert sched.cache.settle_one() == SETTLE_ROWS

    def broken(spans):
        raise RuntimeError("llama_decode failed")
    runner.forward = broken
    assert sched.cache.settle_one() == 0 and not sched.cache.settling
    kept = sched.cache.kept[0]
    assert len(kept) == len(a) + SETTLE_ROWS and runner.kv[0] == kept


# -- on the real model ------------------------------------------------------------------------------

def test_the_next_turn_over_a_settled_reply_is_exactly_the_cold_answer(real):  # noqa: F811
    runner, found = real
    cfg = EngineConfig(n_slots=1, n_ctx=1024, prefill_chunk=128, cache_ram_bytes=0)
    events: list = []
    sched = Scheduler(runner, cfg, events.append, PromptCache.from_config(runner, cfg, grid=Grid(128, found.min_chunk)))
    first = runner.tokenize(STORY, True)[:300]
    reply = greedy(sched, runner, events, "first", first)[0]
    assert len(reply) == 16 and sched.cache.settling
    assert sum(settle_all(sched.cache)) == 16
    # the reply resent, then more than m tokens (m = 64 with flash attention)
    follow = first + reply + runner.tokenize(" And what happened next? " + STORY, False)[:80]
    warm = greedy(sched, runner, events, "warm", follow)
    cold = greedy(sched, runner, events, "cold", follow, cache=False)
    assert warm[2] == len(first) + len(reply) and cold[2] == 0
    assert warm[:2] == cold[:2]    # tokens, and every logprob with its top 5


# -- the engine loop: when it settles ----------------------------------------------------------------

class _Cache:
    settling = True


class _Sched:
    cache = _Cache()

    def __init__(self, work: bool) -> None:
        self.work = work

    def has_work(self) -> bool:
        return self.work


@pytest.mark.parametrize("work, settling, idle_s, expected", [
    (True, True, 1.0, 0.0),                          # requests first, never a wait
    (False, True, 0.0, SETTLE_AFTER_S),              # a reply to settle: wait out the grace only
    (False, True, 1.0, 0.0),                         # ... and past it, one piece after another
    (False, False, 1.0, 0.25)])                      # nothing to do
def test_the_loop_settles_only_after_a_short_idle_grace(work, settling, idle_s, expected):
    loop = EngineLoop.__new__(EngineLoop)
    loop.scheduler = _Sched(work)
    loop.scheduler.cache = type("C", (), {"settling": settling})()
    loop.workers = [loop.scheduler]
    loop._idle_retry_at = 0.0                 # no idle work put off
    got = loop._poll_timeout(time.monotonic() - idle_s)
    assert got == pytest.approx(expected, abs=0.01)


def test_a_turn_that_changes_a_settled_reply_saves_no_state_for_the_few_tokens_it_drops():
    # an agent's client resends the tool call it got, rewritten: the turn reuses the prompt and
    # the reply's first tokens, and what only the slot held (the rest of the reply) is fewer
    # tokens than a reuse is worth, so no state is copied out on the way to the first token
    runner = FakeRunner(n_slots=1, n_ctx=512)
    saves = []
    save = runner.save
    runner.save = lambda slot: saves.append(slot) or save(slot)
    sched, events = make(runner, ram=1 << 20)           # chunk 32: min_reuse 32
    a = list(range(1, 60))
    reply, _ = ask(sched, events, "a", a, max_tokens=20)
    settle_all(sched.cache)
    _, warm = ask(sched, events, "b", a + reply[:3] + [7] * 40, max_tokens=2)
    assert warm.usage.cached_tokens == len(a) + 3 and saves == []
    assert sched.cache.stats().ram_entries == 0
    # a turn that leaves 32 or more kept positions behind saves them first, as before
    _, other = ask(sched, events, "c", a[:20] + [9] * 30, max_tokens=2)
    assert other.usage.cached_tokens == 0 and saves == [0] and sched.cache.stats().ram_entries == 1
