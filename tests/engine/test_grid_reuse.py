"""Reuse to the token: the grid's two regimes, the chunk-invariance probe on runners that are and
are not invariant, the prompt cache in each regime and in fast mode; and on the real model, a
follow-up that reuses a prefix ending anywhere gives exactly the cold answer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config import EngineConfig
from appliance.engine.cache.invariance import check_chunk_invariance, probe_prompt
from appliance.engine.cache.prompt_cache import PromptCache
from appliance.engine.grid import Grid
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Delta, Done, Request, SamplingParams

from .fake_runner import FakeRunner
from .test_prefix_cache import greedy

# -- the grid ---------------------------------------------------------------------------------


def test_grid_reuse_stops_at_grid_lines_and_any_position_reuse_leaves_m_tokens():
    grid, fine = Grid(512), Grid(512, 2)
    assert grid.reusable(700, 1000) == 512 and fine.reusable(700, 1000) == 700
    assert grid.reusable(1000, 1000) == 512 and fine.reusable(1000, 1000) == 998
    assert fine.reusable(200, 202) == 200 and fine.reusable(5, 1) == 0
    assert fine.reusable(63, 1000) == 0 and fine.reusable(64, 1000) == 64   # a few template tokens: no hit
    assert Grid(8, 2).reusable(9, 20) == 9                                   # a small grid: a chunk is enough
    assert grid.keepable(700, 700) == 512 and fine.keepable(700, 700) == 700
    assert fine.keepable(900, 700) == 700 and fine.keepable(1, 1) == 0  # a one-row prompt: never kept
    with pytest.raises(ValueError):
        Grid(4, 3)


@settings(max_examples=300, deadline=None)
@given(chunk=st.integers(4, 600), m=st.integers(1, 16), start=st.integers(0, 3000), n=st.integers(1, 3000))
def test_any_position_chunks_are_between_m_and_chunk_rows(chunk, m, start, n):
    m = min(m, chunk // 2)
    grid, end = Grid(chunk, m), start + n
    pieces = list(grid.chunks(start, end))
    assert pieces[0][0] == start and pieces[-1][1] == end
    assert all(a < b and b == c for (a, b), (c, _) in zip(pieces, pieces[1:] + [(end, None)]))
    if n >= m:
        assert all(m <= b - a <= chunk for a, b in pieces)
    assert all(b - a == chunk for a, b in pieces[:-2])   # whole chunks from the start, wherever it is
    if start == 0:
        assert all(b % chunk == 0 for _, b in pieces[:-2])  # a cold prompt: on the grid's lines


def test_a_cold_prompt_is_cut_on_the_grid_but_never_leaves_a_short_last_piece():
    assert list(Grid(512, 2).chunks(0, 1100)) == [(0, 512), (512, 1024), (1024, 1100)]
    assert list(Grid(512, 2).chunks(0, 1025)) == [(0, 512), (512, 1023), (1023, 1025)]
    assert list(Grid(512).chunks(0, 1025)) == [(0, 512), (512, 1024), (1024, 1025)]
    assert list(Grid(512, 2).chunks(1023, 1100)) == [(1023, 1100)]        # a follow-up: one forward
    assert list(Grid(512, 2).chunks(1676, 2125)) == [(1676, 2125)]
    assert list(Grid(512, 2).chunks(100, 1125)) == [(100, 612), (612, 1123), (1123, 1125)]


# -- the probe ----------------------------------------------------------------------------------


class ShapedRunner(FakeRunner):
    """A fake runner whose KV and logits show how each position was computed: `shape(rows)` of
    the chunk it sat in is folded into both, as a kernel that depends on the chunk would."""

    def __init__(self, shape, **kw) -> None:
        super().__init__(n_slots=1, n_ctx=1024, **kw)
        self.shape, self.marks = shape, [[]]

    def tokenize(self, text, add_special, parse_special=True):
        return [1 + i % 50 for i in range(len(text))]

    def forward(self, spans):
        out = super().forward(spans)
        for s, rows in zip(spans, out):
            self.marks[s.slot] += [self.shape(len(s.tokens))] * len(s.tokens)
            rows += 0.001 * sum(self.marks[s.slot])
        return out

    def truncate(self, slot, n_keep):
        super().truncate(slot, n_keep)
        del self.marks[slot][n_keep:]

    def save(self, slot):
        return super().save(slot) + b"|" + bytes(self.marks[slot])

    def restore(self, slot, blob):
        kv, marks = blob.split(b"|")
        super().restore(slot, kv)
        self.marks[slot] = list(marks)


@pytest.mark.parametrize("shape, m", [(lambda rows: 0, 1),              # any chunk computes alike
                                      (lambda rows: rows == 1, 2),      # a one-row chunk differs (llama.cpp)
                                      (lambda rows: rows < 8, 16),      # short chunks differ
                                      (lambda rows: rows < 64, 64),     # tiled from 64 rows (flash attention)
                                      (lambda rows: rows % 7, 0)])      # every shape differs
def test_the_probe_finds_the_smallest_chunk_that_computes_as_the_grid(shape, m):
    runner = ShapedRunner(shape)
    found = check_chunk_invariance(runner, 0, probe_prompt(runner, 128), 128)
    assert found.min_chunk == m and found.cases >= 4
    assert (not found.failed) == (m == 1) and runner.kv[0] == []


# -- the prompt cache in each mode ---------------------------------------------------------------


def run(sched, events, rid, prompt, max_tokens=3, cache=True):
    sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=max_tokens), prompt="x",
                         cache_prompt=cache), prompt)
    while sched.has_work():
        sched.step()
    return [e for e in events if isinstance(e, Done) and e.request_id == rid][0]


def scheduler(mode="on", m=2, chunk=8, n_slots=1, ram=1 << 20):
    runner = FakeRunner(n_slots=n_slots, n_ctx=512)
    cfg = EngineConfig(n_slots=n_slots, n_ctx=512, prefill_chunk=chunk, step_token_budget=64,
                       prompt_cache=mode, cache_ram_bytes=ram)
    events: list = []
    cache = PromptCache.from_config(runner, cfg, grid=Grid(chunk, m))
    return Scheduler(runner, cfg, events.append, cache), events, runner


def test_any_position_reuse_keeps_the_whole_prompt_and_reuses_to_the_token():
    sched, events, runner = scheduler()
    a = list(range(1, 22))                                    # 21 tokens: off the 8-token grid
    run(sched, events, "a", a)
    assert sched.cache.kept[0] == a                            # the whole prompt, not 16 of it
    done = run(sched, events, "b", a + [40, 41, 42])
    assert done.usage.cached_tokens == 21 and done.timings.cache_reuse == "exact"
    assert run(sched, events, "c", a + [40]).usage.cached_tokens == 20   # m = 2 left to compute
    assert [len(s.tokens) for call in runner.calls[-3:] for s in call][0] == 2  # computed as one 2-row chunk


def test_a_follow_up_is_cut_in_whole_chunks_from_where_it_starts():
    sched, events, runner = scheduler(ram=0)
    a = list(range(1, 22))
    run(sched, events, "a", a)
    n = len(runner.calls)
    run(sched, events, "b", a + list(range(30, 46)))          # 16 new tokens from position 21
    prefill = [(s.start_pos, len(s.tokens)) for call in runner.calls[n:] for s in call if s.start_pos < 37]
    assert prefill[:2] == [(21, 8), (29, 8)]                   # not 21-24, 24-32, 32-37 on the grid


def test_grid_reuse_when_the_runner_proved_nothing():
    sched, events, _ = scheduler(m=0)
    a = list(range(1, 22))
    run(sched, events, "a", a)
    assert sched.cache.kept[0] == a[:16]
    assert run(sched, events, "b", a + [40, 41, 42]).usage.cached_tokens == 16


def test_a_state_restored_from_ram_is_reused_to_the_token():
    sched, events, _ = scheduler()
    a = list(range(1, 30))
    run(sched, events, "a", a)
    run(sched, events, "other", [60] * 12)                    # takes the slot: a's state goes to RAM
    done = run(sched, events, "b", a + [45, 46])
    assert done.usage.cached_tokens == 29 and sched.cache.ram.hits == 1


def test_fast_mode_reuses_replies_and_says_so():
    sched, events, runner = scheduler(mode="fast", m=0)       # a runner that proved nothing
    a = list(range(1, 22))
    first = run(sched, events, "a", a, max_tokens=4)
    reply = [t for e in events if isinstance(e, Delta) and e.request_id == "a" for t in e.token_ids]
    assert first.timings.cache_reuse == "exact" and len(reply) == 4
    # the next turn resends the reply: fast mode reuses it, prompt and reply, to the token
    follow = run(sched, events, "b", a + reply[:3] + [50, 51])
    assert follow.usage.cached_tokens == 24 and follow.timings.cache_reuse == "inexact"
    assert sched.cache.stats().inexact_hits == 1
    # what it computed on an inexact reuse is not exact either: exact reuse of it stops at 16
    assert sched.cache.exact[0] == 16
    # a request that reuses no more than exact reuse would is not labelled
    assert run(sched, events, "c", a[:16] + [7, 7, 7]).timings.cache_reuse == "exact"


def test_on_mode_never_labels_and_never_keeps_a_reply():
    sched, events, _ = scheduler(mode="on", m=2)
    a = list(range(1, 22))
    run(sched, events, "a", a, max_tokens=4)
    reply = [t for e in events if isinstance(e, Delta) and e.request_id == "a" for t in e.token_ids]
    follow = run(sched, events, "b", a + reply[:3] + [50, 51])
    assert follow.usage.cached_tokens == 21 and follow.timings.cache_reuse == "exact"


def test_interleaved_conversations_keep_their_own_slots_while_one_is_free():
    sched, events, _ = scheduler(n_slots=4, ram=0)
    convs = [[100 + c] * 20 for c in range(3)]
    for turn in range(4):
        for c in range(3):
            convs[c] = convs[c] + [c + 1] * 9
            done = run(sched, events, f"c{c}t{turn}", convs[c])
            if turn:
                assert done.usage.cached_tokens == len(convs[c]) - 9, (c, turn)
    # three conversations in four slots: nothing was ever spilled, the fourth slot stayed free
    assert sum(1 for k in sched.cache.kept if k) == 3


# -- on the real model ------------------------------------------------------------------------------

STORY = ("The lighthouse keeper climbed the stairs every evening to light the lamp, and wrote down "
         "the ships he saw. ") * 20
ASK = " What did the keeper write down on the night of the storm, and why?"


@pytest.fixture(scope="module", params=[False, True], ids=["default-attention", "flash-attention"])
def real(request):
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from appliance.models import embedded_model_path

    cfg = EngineConfig(plan="off", n_slots=1, n_ctx=1024, n_threads=2, flash_attn=request.param)
    runner = LlamaCppRunner(cfg, embedded_model_path(), "smol")
    found = check_chunk_invariance(runner, 0, probe_prompt(runner, 128), 128)
    yield runner, found
    runner.close()


def test_llamacpp_computes_any_chunk_of_two_rows_or_with_flash_attention_64_as_the_grid(real):
    # measured on x86 CPUs with llama-cpp-python 0.3.36. Default attention: one-row chunks take
    # another matmul path. Flash attention with f16 KV: chunks of 64 rows or more are computed
    # in 64-row tiles, shorter ones row by row in f16, and every smaller candidate fails
    runner, found = real
    if runner.llamacpp.flash_attn:
        assert found.min_chunk == 64 and len(found.failed) == 5, found
    else:
        assert found.min_chunk == 2 and len(found.failed) == 1, found
    assert found.failed[0].startswith("m=1")


def test_follow_ups_reusing_a_prefix_that_ends_anywhere_give_the_cold_answer(real):
    runner, found = real
    m = found.min_chunk
    cfg = EngineConfig(n_slots=1, n_ctx=1024, prefill_chunk=128, cache_ram_bytes=1 << 30)
    events: list = []
    cache = PromptCache.from_config(runner, cfg, grid=Grid(128, m))
    sched = Scheduler(runner, cfg, events.append, cache)
    story, ask = runner.tokenize(STORY, True), runner.tokenize(ASK, False)
    rng = np.random.default_rng(3)
    checked = 0
    for first_len in (129, 200, 257, 301):                  # earlier prompts ending off the grid
        extra = int(rng.integers(2, 40))
        greedy(sched, runner, events, "first", story[:first_len])
        follow = story[:first_len] + ask[:extra]
        warm = greedy(sched, runner, events, "warm", follow)
        cold = greedy(sched, runner, events, "cold", follow, cache=False)
        # reused to the token, leaving m to compute
        assert warm[2] == min(first_len, len(follow) - m) and cold[2] == 0
        assert warm[:2] == cold[:2], f"first prompt {first_len}, {extra} tokens added"
        checked += 1
    # a shorter prompt that shares part of the last one (a retry, an edited question)
    part = story[:233]
    warm, cold = greedy(sched, runner, events, "w", part), greedy(sched, runner, events, "c", part, cache=False)
    assert warm[2] == 233 - m and warm[:2] == cold[:2] and checked == 4
