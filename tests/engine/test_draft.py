"""The draft model on fake runners: its KV kept in step with the target's (the fake runner
asserts every span continues the slot's KV), its drafts verified to the serial output token
for token whether they are all right or all wrong, the vocabulary check, the cost arithmetic
of drafting with a model, and the policy and request modes around it."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine import spec
from appliance.engine.spec import probe
from appliance.engine.grid import Grid
from appliance.engine.spec.draft import DraftModel, check_vocab
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Error, Request, SamplingParams
from appliance.errors import ModelLoadError

from . import test_speculate as speculate_tests
from .fake_runner import N_VOCAB, FakeRunner

CYCLE = tuple(range(N_VOCAB - 1)) * 2 + tuple(range(10))   # prompt lookup drafts it right
PLAIN = tuple(range(10))   # the fake model continues 10, 11, ...: nothing repeats, no lookup draft
FREE_ROWS = spec.CostModel((1, 16), (1.0, 1.0))


class StepRunner(FakeRunner):
    """A draft model that predicts last + `step`: step 1 is the target's own model (every draft
    accepted), any other step is always wrong."""

    def __init__(self, n_slots: int = 2, n_ctx: int = 4096, step: int = 1, n_vocab: int = N_VOCAB) -> None:
        super().__init__(n_slots, n_ctx)
        self.step, self.n = step, n_vocab
        self.info = type(self.info)(**{**self.info.__dict__, "n_vocab": n_vocab})

    def forward(self, spans):
        self.calls.append(list(spans))
        out = []
        for s in spans:
            assert s.start_pos == len(self.kv[s.slot]), "span must continue the slot's KV"
            self.kv[s.slot].extend(s.tokens)
            rows = np.zeros((s.n_logits, self.n), np.float32)
            for r in range(s.n_logits):
                rows[r, (s.tokens[len(s.tokens) - s.n_logits + r] + self.step) % self.n] = 1.0
            out.append(rows)
        return out


def policy(unit: float = 0.0, prior: float = 0.5) -> spec.Policy:
    return spec.Policy("draft", ("lookup", "draft"), False, "test", FREE_ROWS,
                       draft=spec.DraftCost(unit, FREE_ROWS, prior))


def generate(pol, params, draft_runner=None, prompt=PLAIN, n=1, n_slots=2, speculate=None, chunk=512):
    """test_speculate's generate, with a draft model whose KV is checked after every step:
    what it holds is what it believes it holds."""
    drafter = DraftModel(draft_runner, N_VOCAB, Grid(chunk)) if draft_runner is not None else None
    events: list = []

    def check() -> None:
        if drafter is not None:
            assert all(drafter.have[s] == draft_runner.kv[s] for s in range(n_slots))

    outs, done, steps, _ = speculate_tests.generate(pol, params, prompt, n_slots, speculate=speculate, n=n,
                                                    drafter=drafter, chunk=chunk, events=events, after_step=check)
    return outs, done, steps, events


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=1.5, max_tokens=40, seed=3),
    SamplingParams(temperature=0.0, max_tokens=40, stop=("hij",)),
])
@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("n", [1, 2])
def test_draft_model_output_equals_serial(params, step, n):
    serial, serial_done, serial_steps, _ = generate(spec.Policy(), params, n=n)
    drafted, done, steps, _ = generate(policy(), params, StepRunner(step=step), n=n)
    assert drafted == serial
    assert [d.finish_reason for d in done] == [d.finish_reason for d in serial_done]
    t = done[0].timings
    assert t.speculation == "draft" and t.draft_n > 0
    if params.temperature == 0 and not params.stop:
        if step == 1:  # the draft model is the target's: every draft is accepted
            assert t.draft_n_accepted == t.draft_n and steps < serial_steps / 3
        else:
            assert t.draft_n_accepted == 0


def test_a_draft_mode_stream_takes_prompt_lookups_draft_where_it_promises_more():
    """A draft model that is always wrong, on a prompt that lookup drafts right: the stream
    learns that the model's drafts fail and lookup's pass, and goes on with lookup's."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    serial, *_ = generate(spec.Policy(), params, prompt=CYCLE)
    drafted, done, steps, _ = generate(policy(unit=0.3), params, StepRunner(step=2), prompt=CYCLE)
    assert drafted == serial
    t = done[0].timings
    assert t.draft_n_accepted > 30 and steps < 15


def test_streams_draft_together_in_one_draft_forward_per_token():
    draft = StepRunner(n_slots=3)
    generate(policy(), SamplingParams(temperature=0.0, max_tokens=30), draft, n=3, n_slots=3)
    assert max(len(call) for call in draft.calls) == 3
    assert any(len(call) == 3 and all(len(s.tokens) == 1 for s in call) for call in draft.calls)


def test_the_draft_model_prefills_along_with_the_target():
    """A 300-token prompt in 64-token chunks: the draft model takes each chunk in the step the
    target does, so the first drafting step feeds it one token."""
    prompt = tuple(i % 50 for i in range(300))
    draft = StepRunner()
    generate(policy(), SamplingParams(temperature=0.0, max_tokens=4), draft, prompt=prompt, chunk=64)
    sizes = [len(s.tokens) for call in draft.calls for s in call]
    assert sizes[:5] == [64, 64, 64, 64, 44] and max(sizes[5:]) <= 2


def test_a_slot_reused_by_a_new_request_keeps_the_shared_prefix_in_the_draft_model():
    drafter = DraftModel(StepRunner(n_slots=1), N_VOCAB, Grid(16))
    drafter.propose([(0, list(range(40)), 4)])
    before = len(drafter.runner.calls)
    drafter.propose([(0, list(range(30)) + [7, 8], 4)])
    first = drafter.runner.calls[before]
    assert first[0].start_pos == 30 and first[0].tokens == (7, 8)  # cut to the common prefix, then caught up


def test_a_draft_token_the_target_does_not_have_ends_the_draft():
    drafter = DraftModel(StepRunner(n_slots=1, n_vocab=N_VOCAB + 8), N_VOCAB, Grid(512))
    (got,) = drafter.propose([(0, [N_VOCAB - 4], 8)])
    assert got == (N_VOCAB - 3, N_VOCAB - 2, N_VOCAB - 1)


def test_agreement_is_the_share_of_equal_argmaxes():
    target = FakeRunner(n_slots=1)
    assert DraftModel(StepRunner(n_slots=1), N_VOCAB, Grid(512)).agreement(target, 0, list(range(20))) == 1.0
    assert DraftModel(StepRunner(n_slots=1, step=2), N_VOCAB, Grid(512)).agreement(target, 0, list(range(20))) == 0.0
    assert target.kv[0] == []


class OtherVocab(StepRunner):
    def detokenize(self, ids):
        return b"x" if list(ids) == [17] else super().detokenize(ids)


def test_a_draft_model_with_another_vocabulary_is_refused():
    check_vocab(StepRunner(n_vocab=N_VOCAB + 100), FakeRunner(), "ok.gguf")
    with pytest.raises(ModelLoadError, match="token 17"):
        check_vocab(OtherVocab(), FakeRunner(), "other.gguf")
    with pytest.raises(ModelLoadError, match="vocabulary has 264 tokens"):
        check_vocab(StepRunner(n_vocab=N_VOCAB + 200), FakeRunner(), "big.gguf")


def test_reset_forgets_the_draft_kv():
    drafter = DraftModel(StepRunner(n_slots=1), N_VOCAB, Grid(512))
    drafter.propose([(0, [1, 2, 3], 2)])
    drafter.reset()
    assert drafter.have == [[]] and drafter.runner.kv == [[]]


# -- arithmetic and policy ----------------------------------------------------------------------

def test_draft_cost_counts_the_forwards_streams_share():
    c = spec.CostModel((1, 2, 4), (1.0, 1.5, 2.5))
    d = spec.DraftCost(0.25, c)
    assert d([]) == 0.0 and d([0, 0]) == 0.0
    assert d([3, 1, 0]) == pytest.approx(0.25 * (c(2) + c(1) + c(1)))


@pytest.mark.parametrize("unit", [0.05, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("accept", [0.3, 0.6, 0.9, 0.99])
def test_one_stream_drafts_with_a_model_exactly_when_it_pays(unit, accept):
    cost = spec.CostModel((1, 2, 4, 8, 16), (1.0, 1.1, 1.25, 1.6, 2.5))
    draft = spec.DraftCost(unit, spec.CostModel((1, 2), (1.0, 1.2)))
    (k,) = speculate_tests.plan_drafts([(accept, 15)], cost, draft, [True])
    rates = {j: spec.expected_tokens(accept, j) / (cost(1 + j) + unit * j) for j in spec.K_CHOICES}
    best = max(rates.values())
    if best > spec.MIN_GAIN:
        assert rates[k] == best
    else:
        assert k == 0
    if unit >= 1.0:  # a draft model as slow as the target never pays
        assert k == 0


def test_the_policy_prefers_the_draft_model_when_one_is_loaded():
    exact, cost = probe.Exactness(True, 0.0, 0, 9), FREE_ROWS
    d = spec.DraftCost(0.3, cost, 0.8)
    p = spec.decide("auto", False, exact, cost, d)
    assert p.default == "draft" and p.modes == ("lookup", "draft") and p.label("draft") == "draft"
    assert spec.decide("lookup", False, exact, cost, d).default == "lookup"
    assert spec.decide("auto", False, exact, cost).refusal("draft") == \
        "this server has no draft model (start it with --draft-model)"
    with pytest.raises(ValueError, match="--speculate draft"):
        spec.decide("draft", False, probe.Exactness(False, 1.0, 1, 9), cost, d)
    assert p.as_dict()["draft"]["prior_accept"] == 0.8


def test_asking_for_draft_without_a_draft_model_is_a_clear_error():
    lookup_only = spec.Policy("lookup", ("lookup",), False, "test", FREE_ROWS)
    _, _, _, events = generate(lookup_only, SamplingParams(max_tokens=4), speculate="draft")
    (err,) = [e for e in events if isinstance(e, Error)]
    assert err.kind == "InvalidRequest" and "--draft-model" in err.message


def test_draft_requests_start_from_the_measured_prior():
    runner, events = FakeRunner(n_slots=1), []
    sched = Scheduler(runner, EngineConfig(n_slots=1, n_ctx=512), events.append,
                      spec=spec.Speculator(policy(prior=0.9), DraftModel(StepRunner(n_slots=1), N_VOCAB, Grid(512))))
    sched.submit(Request(id="a", params=SamplingParams(max_tokens=4), prompt_ids=(1, 2)), [1, 2])
    assert sched.by_id["a"].spec.mode == "draft" and sched.by_id["a"].spec.acc.rate == pytest.approx(0.9)


def test_the_draft_cost_follows_what_steps_measure():
    """The start-up ratio of draft to target forward times moves towards what each all-decode
    step observes: drafts of 4 tokens took 20 ms (5 ms a forward) while the verify took 30 ms
    for 1.5 one-row steps (20 ms a step): a ratio of 0.25 seen, against 0.5 believed."""
    drafter = DraftModel(StepRunner(n_slots=1), N_VOCAB, Grid(512))
    drafter.cost = spec.DraftCost(0.5, spec.CostModel(), 0.9)
    drafter.last = (0.020, (4,))
    drafter.observe(0.030, 1.5)
    assert drafter.cost.unit == pytest.approx(0.7 * 0.5 + 0.3 * 0.25) and drafter.last is None
    drafter.observe(0.030, 1.5)            # nothing drafted since: nothing to learn
    assert drafter.cost.unit == pytest.approx(0.425)


def test_the_scheduler_feeds_the_draft_cost_with_its_steps():
    draft = StepRunner()
    runner, events = FakeRunner(), []
    drafter = DraftModel(draft, N_VOCAB, Grid(512))
    drafter.cost = spec.DraftCost(1e-6, FREE_ROWS, 0.9)
    sched = Scheduler(runner, EngineConfig(n_slots=2, n_ctx=4096), events.append,
                      spec=spec.Speculator(policy(), drafter))
    sched.submit(Request(id="a", params=SamplingParams(temperature=0.0, max_tokens=40), prompt_ids=PLAIN), list(PLAIN))
    while sched.has_work():
        sched.step()
    assert drafter.cost.unit > 1e-5  # real time passed in the fake draft model's forwards


def test_a_stream_with_both_drafts_takes_the_one_that_promises_more():
    cost = spec.CostModel((1, 2, 4, 8, 16), (1.0, 1.1, 1.25, 1.6, 2.5))
    draft = spec.DraftCost(0.3, spec.CostModel((1, 2), (1.0, 1.2)))
    model, copying, guessing = (0.9, 15, True), (0.9, 8, False), (0.1, 8, False)
    assert spec.plan_options([[model, copying]], cost, draft)[0][0] == 1   # as sure, and free
    (o, k), = spec.plan_options([[model, guessing]], cost, draft)
    assert o == 0 and k > 0
    assert spec.plan_options([[model, guessing]], cost, spec.DraftCost(2.0, draft.cost)) == [(0, 0)]


def test_common_prefix_against_the_plain_loop():
    import random

    from appliance.engine.grid import common_prefix

    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(10))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n == common_prefix(b, a)
