"""Scheduler behaviour with a fake runner: admission, chunked prefill, queue bound,
cancellation, the context limit, finishing rules."""
from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Accepted, Delta, Done, Error, Progress, Request, SamplingParams

from .fake_runner import EOG, FakeRunner

GREEDY = SamplingParams(temperature=0.0)


def make(n_slots=2, n_ctx=4096, **cfg):
    runner = FakeRunner(n_slots=n_slots, n_ctx=n_ctx)
    events = []
    sched = Scheduler(runner, EngineConfig(n_slots=n_slots, n_ctx=n_ctx, **cfg), events.append)
    return sched, runner, events


def req(rid, max_tokens=4, **kw):
    return Request(id=rid, params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), prompt="x")


def of(events, rid, kind=None):
    return [e for e in events if e.request_id == rid and (kind is None or isinstance(e, kind))]


def run(sched, limit=1000):
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def test_first_event_is_accepted_then_deltas_then_done():
    sched, _, events = make()
    sched.submit(req("a", max_tokens=3), [1, 2, 3])
    run(sched)
    evs = of(events, "a")
    assert isinstance(evs[0], Accepted) and evs[0].n_prompt_tokens == 3
    assert isinstance(evs[-1], Done) and evs[-1].finish_reason == "length"
    # the fake model counts up from the last prompt token
    assert [d.token_ids for d in of(events, "a", Delta)] == [(4,), (5,), (6,)]
    assert "".join(d.text for d in of(events, "a", Delta)) == "efg"
    assert evs[-1].usage.completion_tokens == 3 and evs[-1].usage.prompt_tokens == 3


def test_requests_beyond_slots_wait_and_are_admitted_in_order():
    sched, runner, events = make(n_slots=2)
    for rid in "abc":
        sched.submit(req(rid, max_tokens=5), [1, 2])
    sched.step()
    assert {a.req.id for a in sched.slots if a} == {"a", "b"}
    assert [a.req.id for a in sched.waiting] == ["c"]
    run(sched)
    assert all(of(events, rid, Done) for rid in "abc")
    # c produced nothing before a slot was freed
    first_done = min(events.index(of(events, rid, Done)[0]) for rid in "ab")
    assert events.index(of(events, "c", Delta)[0]) > first_done


def test_new_request_joins_running_batch():
    sched, runner, _ = make(n_slots=2)
    sched.submit(req("a", max_tokens=10), [1, 2])
    sched.step()
    sched.step()
    sched.submit(req("b", max_tokens=10), [3, 4])
    sched.step()
    last = runner.calls[-1]
    # a's decode row and b's prompt went into the same step
    assert {s.slot for s in last} == {0, 1}
    sched.step()
    assert sorted(len(s.tokens) for s in runner.calls[-1]) == [1, 1]
    assert sched.stats().max_decode_batch == 2


def test_long_prompt_is_chunked_on_a_fixed_grid_and_never_stalls_decode():
    sched, runner, events = make(n_slots=2, prefill_chunk=256, step_token_budget=256)
    sched.submit(req("a", max_tokens=50), [1, 2, 3])
    sched.step()  # a prefilled
    prompt = [i % 50 for i in range(700)]
    sched.submit(req("b", max_tokens=2), prompt)
    chunks = []
    while sched.slots[1] is None or sched.slots[1].prefilling:
        n_before = len(of(events, "a", Delta))
        sched.step()
        call = runner.calls[-1]
        chunks += [(s.start_pos, len(s.tokens)) for s in call if s.slot == 1]
        assert len(of(events, "a", Delta)) == n_before + 1, "a decodes one token every step"
    assert chunks == [(0, 256), (256, 256), (512, 188)]


def test_return_progress_reports_the_prefill_chunk_by_chunk_before_the_first_token():
    sched, _, events = make(n_slots=1, prefill_chunk=256, step_token_budget=256)
    prompt = [i % 50 for i in range(700)]
    sched.submit(Request(id="p", params=GREEDY, prompt="x", return_progress=True), prompt)
    sched.submit(req("q", max_tokens=2), [1, 2, 3])    # not asked: no progress
    run(sched)
    got = of(events, "p", Progress)
    assert [(e.total, e.cache, e.processed) for e in got] == [(700, 0, 0), (700, 0, 256), (700, 0, 512),
                                                              (700, 0, 700)]
    assert got[0].time_ms == 0.0 and got[-1].time_ms >= got[1].time_ms > 0.0
    order = [type(e) for e in of(events, "p")]
    assert order.index(Delta) > max(i for i, t in enumerate(order) if t is Progress)
    assert not of(events, "q", Progress)


def test_chunk_grid_is_absolute_whatever_else_runs():
    def chunks_of(other_prompt_len):
        sched, runner, _ = make(n_slots=2, prefill_chunk=128, step_token_budget=128)
        if other_prompt_len:
            sched.submit(req("x", max_tokens=3), list(range(other_prompt_len)))
        sched.submit(req("b", max_tokens=1), [i % 60 for i in range(300)])
        run(sched)
        slot_b = 1 if other_prompt_len else 0
        return [(s.start_pos, len(s.tokens)) for call in runner.calls for s in call
                if s.slot == slot_b and len(s.tokens) > 1]

    assert chunks_of(0) == chunks_of(200) == [(0, 128), (128, 128), (256, 44)]


def test_queue_bound_refuses_with_queue_full():
    sched, _, events = make(n_slots=1, max_queue=1)
    sched.submit(req("a"), [1])
    sched.submit(req("b"), [1])
    sched.step()  # a takes the slot, b waits
    sched.submit(req("c"), [1])
    sched.submit(req("d"), [1])
    err = of(events, "d", Error)
    assert err and err[0].kind == "QueueFull"
    assert of(events, "c", Accepted)
    assert not of(events, "d", Accepted)


def test_context_limit_refused_before_any_work():
    sched, runner, events = make(n_ctx=64)
    sched.submit(req("a", max_tokens=10), list(range(60)))
    (err,) = of(events, "a")
    assert isinstance(err, Error) and err.kind == "ContextOverflow"
    assert err.fields["n_prompt_tokens"] == 60 and err.fields["n_ctx"] == 64
    assert not sched.has_work() and runner.calls == []


def test_without_max_tokens_output_stops_at_the_context_end():
    sched, _, events = make(n_ctx=16)
    sched.submit(Request(id="a", params=GREEDY, prompt="x"), [1, 2, 3, 4, 5, 6])
    run(sched)
    done = of(events, "a", Done)[0]
    assert done.finish_reason == "length" and done.usage.total_tokens == 16


def test_cancel_frees_the_slot_within_one_step():
    sched, runner, events = make(n_slots=1)
    sched.submit(req("a", max_tokens=1000), [1, 2])
    sched.submit(req("b", max_tokens=2), [5])
    sched.step()
    sched.step()
    sched.abort("a")
    sched.step()
    assert of(events, "a", Done)[0].finish_reason == "cancelled"
    assert sched.slots[0] is not None and sched.slots[0].req.id == "b"
    assert runner.calls[-1][0].tokens == (5,) and runner.calls[-1][0].start_pos == 0


def test_cancel_while_waiting():
    sched, _, events = make(n_slots=1)
    sched.submit(req("a", max_tokens=5), [1])
    sched.submit(req("b", max_tokens=5), [1])
    sched.abort("b")
    run(sched)
    assert of(events, "b", Done)[0].finish_reason == "cancelled"
    assert not of(events, "b", Delta)


def test_end_of_generation_token_stops_and_is_not_emitted():
    sched, _, events = make()
    sched.submit(req("a", max_tokens=10), [EOG - 2])
    run(sched)
    assert [d.token_ids for d in of(events, "a", Delta)] == [(EOG - 1,)]
    done = of(events, "a", Done)[0]
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 1


def test_stop_string_ends_output_and_is_not_leaked():
    sched, _, events = make()
    # output tokens 2,3,4,5... detokenize to "cdef..."
    sched.submit(req("a", max_tokens=10, stop=("ef",)), [1])
    run(sched)
    assert "".join(d.text for d in of(events, "a", Delta)) == "cd"
    assert of(events, "a", Done)[0].finish_reason == "stop"


def test_timings_count_decode_steps():
    sched, _, events = make()
    sched.submit(req("a", max_tokens=5), [1, 2, 3])
    run(sched)
    t = of(events, "a", Done)[0].timings
    assert t.prompt_n == 3 and t.predicted_n == 4  # the first token comes from the prefill
    assert t.predicted_ms > 0 and t.prompt_ms > 0


def test_runner_failure_fails_every_request():
    from appliance.errors import EngineFailure

    sched, _, events = make(n_slots=1)
    sched.submit(req("a"), [1])
    sched.submit(req("b"), [1])
    sched.step()
    sched.fail_all(EngineFailure("boom"))
    assert of(events, "a", Error) and of(events, "b", Error)
    assert not sched.has_work()


@pytest.mark.parametrize("n_slots", [1, 3])
def test_every_request_gets_exactly_one_terminal_event(n_slots):
    sched, _, events = make(n_slots=n_slots)
    for i in range(7):
        sched.submit(req(f"r{i}", max_tokens=1 + i % 3), [i + 1] * (1 + i))
    sched.abort("r3")
    run(sched)
    for i in range(7):
        assert len([e for e in of(events, f"r{i}") if isinstance(e, (Done, Error))]) == 1


def test_negative_and_huge_seeds_are_valid():
    sched, _, events = make()
    sched.submit(Request(id="a", params=SamplingParams(temperature=0.8, seed=-5, max_tokens=2), prompt="x"), [1])
    sched.submit(Request(id="b", params=SamplingParams(temperature=0.8, seed=2**64 - 1, max_tokens=2), prompt="x"), [1])
    run(sched)
    assert of(events, "a", Done) and of(events, "b", Done)



def _sampled(sched, events, rid, seed=None):
    sched.submit(Request(id=rid, params=SamplingParams(temperature=2.0, seed=seed, max_tokens=12), prompt="x"), [1])
    run(sched)
    return [t for d in of(events, rid, Delta) for t in d.token_ids]


def test_server_seed_is_the_default_for_requests_without_one():
    sched, _, events = make(seed=7)
    assert _sampled(sched, events, "a") == _sampled(sched, events, "b") == _sampled(sched, events, "c", seed=7)
    assert _sampled(sched, events, "d", seed=8) != _sampled(sched, events, "e")


def test_without_a_server_seed_each_request_draws_its_own():
    sched, _, events = make()
    replies = {tuple(_sampled(sched, events, f"r{i}")) for i in range(4)}
    assert len(replies) > 1

def _prompt_cache_run(sched, rid, prompt, cache=True):
    sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=2), prompt="x",
                         cache_prompt=cache), prompt)
    run(sched)


def test_slot_reuse_keeps_whole_blocks_of_the_longest_common_prefix():
    sched, runner, events = make(n_slots=2, prefill_chunk=4, step_token_budget=4)
    a = list(range(1, 11))                    # 10 tokens: blocks [0,4) [4,8) kept
    _prompt_cache_run(sched, "a", a)
    assert sched.cache.kept[0] == a[:8]
    _prompt_cache_run(sched, "b", a[:6] + [40, 41, 42])  # shares 6 -> reuses one block of 4
    done = of(events, "b", Done)[0]
    assert done.usage.cached_tokens == 4 and done.timings.cache_n == 4 and done.timings.prompt_n == 5
    # the rest was computed in the grid's chunks, as a cold run would
    b_chunks = [(s.start_pos, len(s.tokens)) for call in runner.calls[-4:] for s in call if len(s.tokens) > 1]
    assert b_chunks[0] == (4, 4)
    assert sched.stats().cache.cache_hit_tokens == 4


def test_reuse_never_covers_the_last_prompt_token_and_respects_cache_off():
    sched, _, events = make(n_slots=1, prefill_chunk=4, step_token_budget=4)
    p = list(range(1, 9))                     # exactly two blocks
    _prompt_cache_run(sched, "a", p)
    _prompt_cache_run(sched, "b", p)          # a resend: the last block is recomputed for its logits
    assert of(events, "b", Done)[0].usage.cached_tokens == 4
    _prompt_cache_run(sched, "c", p, cache=False)
    assert of(events, "c", Done)[0].usage.cached_tokens == 0


def test_the_best_slot_is_chosen_and_a_failure_forgets_everything():
    from appliance.errors import EngineFailure

    sched, _, events = make(n_slots=2, prefill_chunk=4, step_token_budget=8)
    sched.submit(req("a", max_tokens=2), list(range(1, 13)))
    sched.submit(req("b", max_tokens=2), list(range(20, 32)))
    run(sched)
    _prompt_cache_run(sched, "c", list(range(20, 30)))
    assert of(events, "c", Done)[0].usage.cached_tokens == 8
    assert sched.slots == [None, None]
    sched.fail_all(EngineFailure("boom"))
    assert sched.cache.kept == [[], []]


# -- the context limit's words ---------------------------------------------------------------------

def _overflow(n_prompt, max_tokens=None, n_ctx=1024, **cfg):
    sched, _, events = make(n_ctx=n_ctx, **cfg)
    sched.submit(Request(id="a", params=SamplingParams(max_tokens=max_tokens), prompt="x"), [1] * n_prompt)
    (err,) = of(events, "a")
    assert isinstance(err, Error) and err.kind == "ContextOverflow"
    return err


def test_a_prompt_over_the_context_without_max_tokens_says_by_how_much():
    err = _overflow(2031)
    assert err.message == ("the prompt alone is 2031 tokens, over the context of 1024 tokens per slot by 1007: "
                           "shorten it by at least 1008 tokens to leave room for a reply")
    assert err.fields == {"param": "prompt", "n_prompt_tokens": 2031, "n_ctx": 1024}   # no negative max_tokens
    assert _overflow(1024).message == ("the prompt alone is 1024 tokens, all of the context of 1024 tokens per "
                                       "slot: shorten it by at least 1 token to leave room for a reply")
    assert _overflow(2031, max_tokens=10).message == _overflow(2031).message


def test_a_prompt_that_fits_without_its_max_tokens_says_what_would_fit():
    err = _overflow(1000, max_tokens=100)
    assert err.message == ("this request needs 1000 prompt tokens + 100 max_tokens, more than the context of "
                           "1024 tokens per slot: ask for at most 24 max_tokens or shorten the prompt")
    assert err.fields == {"param": "prompt", "n_prompt_tokens": 1000, "n_ctx": 1024, "max_tokens": 100}
    assert "+ 50 max_tokens" in _overflow(1000, max_tokens_default=50).message


# -- n > 1: choices sharing one prefill ------------------------------------------------------------

def _choices(n, seed=5, max_tokens=4, prompt=tuple(range(1, 11)), **kw):
    return Request(id="a", params=SamplingParams(temperature=2.0, seed=seed, max_tokens=max_tokens), prompt="x",
                   n=n, **kw), list(prompt)


def test_choices_share_one_prefill_and_end_with_one_done():
    sched, runner, events = make(n_slots=3, max_choices=3)
    sched.submit(*_choices(3))
    run(sched)
    prefilled = [s for call in runner.calls for s in call if len(s.tokens) > 1]
    assert len(prefilled) == 1 and prefilled[0].tokens == tuple(range(1, 11))   # one prefill for three replies
    deltas = of(events, "a", Delta)
    assert {d.index for d in deltas} == {0, 1, 2}
    (done,) = of(events, "a", Done)
    assert [c.index for c in done.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in done.choices)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (10, 12)   # the prompt counted once
    for c in done.choices:
        assert [t for d in deltas if d.index == c.index for t in d.token_ids] == list(c.token_ids)
    assert len({c.token_ids for c in done.choices}) > 1                       # each choice its own seed
    assert not sched.has_work() and sched.slots == [None] * 3


def test_choice_0_is_the_reply_n_1_gives():
    sched, _, events = make(n_slots=3)
    sched.submit(*_choices(1))
    run(sched)
    alone = of(events, "a", Done)[0].token_ids
    sched.submit(*_choices(3))
    run(sched)
    assert of(events, "a", Done)[-1].choices[0].token_ids == alone


def test_choices_wait_for_enough_free_slots_in_order():
    sched, _, events = make(n_slots=2)
    sched.submit(req("long", max_tokens=6), [1, 2])
    sched.submit(*_choices(2, max_tokens=2))
    sched.submit(req("after", max_tokens=2), [3])
    sched.step()
    assert [a.req.id for a in sched.slots if a] == ["long"] and [a.req.id for a in sched.waiting] == ["a", "after"]
    run(sched)
    assert of(events, "a", Done)[0].usage.completion_tokens == 4 and of(events, "after", Done)


def test_more_choices_than_the_bound_is_a_400_naming_both_flags():
    sched, runner, events = make(n_slots=2, max_choices=4)
    sched.submit(*_choices(3))
    (err,) = of(events, "a")
    assert isinstance(err, Error) and err.kind == "InvalidRequest" and err.fields["param"] == "n"
    assert err.message == ("n=3 asks for more choices than this server generates at once: at most 2 (each choice "
                           "takes a slot; --max-choices 4, --n-slots 2)")
    assert runner.calls == []


def test_aborting_a_request_cancels_every_choice():
    sched, _, events = make(n_slots=3)
    sched.submit(*_choices(3, max_tokens=100))
    sched.step()
    sched.step()
    sched.abort("a")
    sched.step()
    (done,) = of(events, "a", Done)
    assert done.finish_reason == "cancelled" and len(done.choices) == 3 and sched.slots == [None] * 3


# -- logprobs travel with the text they made -------------------------------------------------------

@pytest.mark.parametrize("stop,text", [(("dx",), "cdefgh"), (("ef",), "cd")])
def test_a_tokens_logprob_goes_with_its_text_and_never_alone(stop, text):
    sched, _, events = make()
    sched.submit(req("a", max_tokens=6, stop=stop, logprobs=True), [1])
    run(sched)
    deltas = of(events, "a", Delta)
    assert "".join(d.text for d in deltas) == text and all(d.text for d in deltas)
    # held text (a stop's possible start) is released with its tokens' logprobs; a stop's own are dropped
    assert [e.token for d in deltas for e in d.logprobs] == list(text)
    assert all(d.logprobs and "".join(e.token for e in d.logprobs) == d.text for d in deltas)
