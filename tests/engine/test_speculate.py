"""Speculative decoding: the n-gram matcher, the adaptive arithmetic, the exactness check and
the policy it leads to, and the scheduler's verify path on a fake runner (serial output, token
for token, greedy and sampled)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine import spec
from appliance.engine.spec import probe
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Delta, Done, Error, Request, SamplingParams

from .fake_runner import N_VOCAB, FakeRunner

# -- the n-gram matcher -------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_longest_matching_suffix():
    idx = spec.NgramIndex([5, 6, 7, 8, 9, 1, 7, 3, 3, 6, 7])
    # suffix (6, 7) occurred at 1..2 and was followed by 8, 9, 1, ...; the 1-gram (7,) most
    # recently by 3: the longer match wins
    assert idx.propose(3) == (8, 9, 1)
    assert idx.propose(1) == (8,)


def test_lookup_takes_the_most_recent_occurrence_and_never_its_own_suffix():
    idx = spec.NgramIndex([1, 2, 10, 1, 2, 20, 1, 2])
    assert idx.propose(2) == (20, 1)
    assert spec.NgramIndex([4, 4]).propose(3) == (4,)      # the earlier 4 is followed by a 4
    assert spec.NgramIndex([1, 2, 3]).propose(3) == ()     # nothing repeats
    assert spec.NgramIndex([]).propose(3) == ()


def test_lookup_follows_the_context_as_it_grows():
    idx = spec.NgramIndex([1, 2, 3, 4])
    assert idx.propose(2) == ()
    idx.extend([1, 2])
    assert idx.propose(2) == (3, 4)
    idx.extend([9])
    assert idx.propose(2) == ()


# -- the arithmetic -----------------------------------------------------------------------------

def test_expected_tokens():
    assert spec.expected_tokens(0.0, 5) == 1.0
    assert spec.expected_tokens(1.0, 5) == 6.0
    assert spec.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cost_model_interpolates_and_extrapolates():
    c = spec.CostModel((1, 2, 4), (1.0, 1.5, 2.5))
    assert c(1) == 1.0 and c(3) == pytest.approx(2.0) and c(6) == pytest.approx(3.5)


def plan_drafts(wants, cost, draft=None, modelled=()):
    """Draft lengths when each stream has one option: (acceptance, longest draft)."""
    modelled = list(modelled) or [False] * len(wants)
    return [k for _, k in spec.plan_options([[(a, n, m)] for (a, n), m in zip(wants, modelled)], cost, draft)]


COSTS = {
    "free rows (memory-bound)": spec.CostModel((1, 16), (1.0, 1.0)),
    "linear (compute-bound)": spec.CostModel((1, 2), (1.0, 2.0)),
    "llama.cpp Q4_1 here": spec.CostModel((1, 2, 4, 8, 16), (1.0, 1.7, 2.6, 4.4, 8.0)),
    "torch int4 here": spec.CostModel((1, 2, 4, 8, 16), (1.0, 1.2, 1.5, 2.2, 3.6)),
}


@pytest.mark.parametrize("name", COSTS)
@pytest.mark.parametrize("accept", [0.0, 0.2, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("avail", [0, 1, 3, 8, 15])
def test_one_stream_drafts_exactly_when_it_pays(name, accept, avail):
    """Against brute force: the chosen k maximises tokens per unit of cost, and is 0 exactly
    when no k beats serial by the margin."""
    cost = COSTS[name]
    (k,) = plan_drafts([(accept, avail)], cost)
    rates = {j: spec.expected_tokens(accept, j) / cost(1 + j) for j in spec.K_CHOICES if j <= avail}
    best = max(rates.values(), default=0.0)
    if best > spec.MIN_GAIN:
        assert k in rates and rates[k] == best
    else:
        assert k == 0


def test_compute_bound_rows_never_draft_and_free_rows_always_do():
    assert plan_drafts([(0.99, 8)] * 3, COSTS["linear (compute-bound)"]) == [0, 0, 0]
    assert plan_drafts([(0.6, 8)] * 3, COSTS["free rows (memory-bound)"]) == [8, 8, 8]


def test_several_streams_draft_only_while_the_whole_step_gains():
    cost = COSTS["torch int4 here"]
    ks = plan_drafts([(0.95, 8), (0.1, 8), (0.95, 0), (0.95, 8)], cost)
    assert ks[1] == 0 and ks[2] == 0 and ks[0] > 0 and ks[3] > 0
    rows = 4 + sum(ks)
    tokens = 4 - 2 + spec.expected_tokens(0.95, ks[0]) + spec.expected_tokens(0.95, ks[3])
    assert tokens / cost(rows) > 4 / cost(4)


def test_acceptance_counts_tried_tokens_and_follows_recent_evidence():
    acc = spec.Acceptance()
    assert acc.rate == spec.PRIOR_ACCEPT
    acc.update(8, 0)          # the first drafted token failed: one try, not eight failures
    assert acc.recent_tried == 1 and acc.proposed == 8
    for _ in range(10):
        acc.update(8, 8)      # then a burst of copying
    assert acc.rate > 0.9
    for _ in range(6):
        acc.update(8, 0)      # and new text again: the estimate falls within a few steps
    assert acc.rate < 0.55


def test_a_request_that_stopped_drafting_tries_again_after_a_while():
    """Rejections push the estimate below what a verify costs; steps without a draft then
    let it drift back to the prior, so a request whose early drafts failed drafts again
    (before, it never did: no draft, no new evidence)."""
    cost = spec.CostModel((1, 2, 4, 8, 16), (1.0, 1.3, 1.7, 2.8, 5.0))   # verifies as dear as at depth here
    sp = spec.Speculator(spec.Policy("lookup", ("lookup",), cost=cost))
    st = sp.start([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], None)
    assert sp.propose([st], [8], [0]) != [()]       # the prior says try
    for _ in range(3):
        st.draft = (9,)
        sp.verified(st, 1, [7])                          # each draft rejected at once
    assert sp.propose([st], [8], [0]) == [()]       # now a draft costs more than it promises
    idle = 0
    while sp.propose([st], [8], [0]) == [()]:
        idle += 1
        assert idle < 20, "the request never drafts again"
    assert 1 <= idle < 20


# -- exactness and the policy -------------------------------------------------------------------

class PerturbingRunner(FakeRunner):
    """Logits from a multi-row span differ in the last bits from one-row steps, as llama.cpp's
    do on this CPU."""

    def forward(self, spans):
        out = super().forward(spans)
        return [o + np.float32(1e-3) * (len(s.tokens) > 1) for o, s in zip(out, spans)]


def test_measured_costs_keep_a_step_between_row_counts(monkeypatch):
    """A kernel that takes rows four at a time costs a step more at 5 rows than at 4; the
    start-up measurement sees it rather than interpolating it away between 4 and 8."""
    clock = [0.0]

    class TiledRunner(FakeRunner):
        def forward(self, spans):
            rows = sum(len(s.tokens) for s in spans)
            clock[0] += 1.0 + 0.8 * ((rows + 3) // 4 - 1) + 0.05 * rows   # a time unit a 4-row tile
            return super().forward(spans)

    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    cost = probe.measure_costs(TiledRunner(n_slots=1), 0, list(range(1, 20)))
    assert cost(4) == pytest.approx(1.2 / 1.05) and cost(5) == pytest.approx(2.05 / 1.05)
    assert cost(5) - cost(4) > 0.7         # the step, where 4..8 interpolated would rise 0.2


def test_check_exact_tells_an_exact_runner_from_a_perturbed_one():
    assert probe.check_exact(FakeRunner(n_slots=1), 0, [1, 2, 3], k=4).exact
    got = probe.check_exact(PerturbingRunner(n_slots=1), 0, [1, 2, 3], k=4)
    assert not got.exact and got.max_abs_diff == pytest.approx(1e-3, rel=1e-3) and got.positions == 5


def test_the_policy_refuses_an_inexact_runner_unless_told():
    cost = spec.CostModel()
    exact = probe.Exactness(True, 0.0, 0, 9)
    inexact = probe.Exactness(False, 1.1, 1, 9)
    assert spec.decide("auto", False, exact, cost).default == "lookup"
    auto = spec.decide("auto", False, inexact, cost)
    assert auto.default == "off" and not auto.allowed and "differs from one-token steps" in auto.reason
    with pytest.raises(ValueError, match="--speculate-inexact"):
        spec.decide("lookup", False, inexact, cost)
    opted = spec.decide("lookup", True, inexact, cost)
    assert opted.allowed and opted.default == "lookup" and opted.label("lookup") == "lookup-inexact"
    assert spec.decide("off", False, exact, cost).default == "off"


# -- the scheduler's verify path ----------------------------------------------------------------

FREE = spec.Policy("lookup", ("lookup",), False, "test", spec.CostModel((1, 16), (1.0, 1.0)))
CYCLE = tuple(range(N_VOCAB - 1)) * 2 + tuple(range(10))   # the fake model predicts last + 1: lookup drafts it right


def generate(policy, params, prompt=CYCLE, n_slots=1, runner_cls=FakeRunner, speculate=None, n=3,
             drafter=None, chunk=512, events=None, after_step=lambda: None):
    runner = runner_cls(n_slots=n_slots)
    events = [] if events is None else events
    sched = Scheduler(runner, EngineConfig(n_slots=n_slots, n_ctx=4096, prefill_chunk=chunk), events.append,
                      spec=spec.Speculator(policy, drafter))
    for i in range(n):
        sched.submit(Request(id=f"r{i}", params=params, prompt_ids=prompt, speculate=speculate), list(prompt))
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        after_step()
    outs = [[t for e in events if isinstance(e, Delta) and e.request_id == f"r{i}" for t in e.token_ids]
            for i in range(n)]
    done = [e for e in events if isinstance(e, Done)]
    return outs, done, steps, sched


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=1.5, max_tokens=40, seed=7),           # sampled: same draws
    SamplingParams(temperature=0.0, max_tokens=40, stop=("hij",)),    # a stop string mid-draft
    SamplingParams(temperature=0.0, max_tokens=5),                    # the length limit mid-draft
    SamplingParams(temperature=0.0, max_tokens=40, logit_bias=((20, -100.0), (40, 0.5))),   # a ban mid-draft
    SamplingParams(temperature=1.5, max_tokens=40, seed=7, logit_bias=((9, 3.0),)),        # the verify's own bias
])
@pytest.mark.parametrize("n_slots", [1, 3])
def test_verified_drafts_give_the_serial_output_token_for_token(params, n_slots):
    serial, serial_done, serial_steps, _ = generate(spec.Policy(), params, n_slots=n_slots)
    drafted, done, steps, sched = generate(FREE, params, n_slots=n_slots)
    assert drafted == serial
    assert [d.finish_reason for d in done] == [d.finish_reason for d in serial_done]
    assert [d.usage for d in done] == [d.usage for d in serial_done]
    if params.temperature == 0 and params.max_tokens == 40 and not (params.stop or params.logit_bias):
        assert steps < serial_steps / 3
        t = done[0].timings
        assert t.speculation == "lookup" and t.draft_n_accepted > 0 and t.tokens_per_step > 3
        assert t.predicted_n == 39 and sched.stats().spec.draft_accepted >= t.draft_n_accepted


def test_a_rejected_draft_is_cut_from_the_kv():
    """A prompt whose earlier continuation disagrees with the model: every draft fails at its
    first token, and the fake runner asserts the KV is truncated each time."""
    prompt = (5, 9, 9, 9, 5)          # lookup proposes 9 after 5; the model says 6
    serial, *_ = generate(spec.Policy(), SamplingParams(temperature=0.0, max_tokens=12), prompt, n=1)
    drafted, done, _, _ = generate(FREE, SamplingParams(temperature=0.0, max_tokens=12), prompt, n=1)
    assert drafted == serial and done[0].timings.draft_n > 0


def test_a_request_asking_for_lookup_on_a_refusing_engine_gets_a_clear_error():
    refused = spec.Policy(reason="this runner's 9-row verify differs from one-token steps")
    runner, events = FakeRunner(n_slots=1), []
    sched = Scheduler(runner, EngineConfig(n_slots=1, n_ctx=512), events.append, spec=spec.Speculator(refused))
    sched.submit(Request(id="a", params=SamplingParams(max_tokens=4), prompt_ids=(1, 2), speculate="lookup"), [1, 2])
    (err,) = events
    assert isinstance(err, Error) and err.kind == "InvalidRequest" and "differs" in err.message


def test_off_per_request_wins_and_inexact_speculation_is_labelled():
    _, done, _, _ = generate(FREE, SamplingParams(temperature=0.0, max_tokens=20), speculate="off", n=1)
    assert done[0].timings.speculation == "off" and done[0].timings.draft_n == 0
    inexact = spec.Policy("lookup", ("lookup",), True, "test", FREE.cost)
    _, done, _, _ = generate(inexact, SamplingParams(temperature=0.0, max_tokens=20),
                             runner_cls=PerturbingRunner, n=1)
    assert done[0].timings.speculation == "lookup-inexact"


def test_spans_of_a_drafting_step_stay_within_the_context():
    outs, done, _, sched = generate(FREE, SamplingParams(temperature=0.0, ignore_eos=True), n=1)  # to the end
    assert done[0].finish_reason == "length" and len(CYCLE) + done[0].usage.completion_tokens == 4096
    assert all(s.start_pos + len(s.tokens) <= 4096 for call in sched.runner.calls for s in call)
    assert list(itertools.islice(outs[0], 3)) == [10, 11, 12]


def test_choices_that_draft_give_the_serial_choices():
    def choices(policy):
        runner, events = FakeRunner(n_slots=3), []
        sched = Scheduler(runner, EngineConfig(n_slots=3, n_ctx=4096), events.append, spec=spec.Speculator(policy))
        params = SamplingParams(temperature=1.5, max_tokens=30, seed=3)
        sched.submit(Request(id="r", params=params, prompt_ids=CYCLE, n=3), list(CYCLE))
        while sched.has_work():
            sched.step()
        return [e for e in events if isinstance(e, Done)][0].choices

    serial, drafted = choices(spec.Policy()), choices(FREE)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in serial] and len(serial) == 3
