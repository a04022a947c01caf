"""The fixed decode shape's decision (spec/shape.py, cost.fixed_shape_pays, policy.decide), on a
runner double whose rows depend on the shape they are computed in, as llama.cpp's plain mode
does: its one-row step and its k-row verify differ, and at a fixed shape they agree. The step
costs are given to the probe (its memo), so the choice is tested at a cheap and a dear shape
without timing anything. The real runner's exactness at the fixed shape is tested on llama.cpp
by test_speculate_identity.py and test_mtp.py."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from appliance.engine import spec
from appliance.engine.runners.base import Span
from appliance.engine.spec.cost import fixed_shape_pays
from appliance.engine.spec.shape import DecodeShape, StepCost, fixed_shape, positions

ROWS = 5


class ModelessRunner:
    """A runner without the fixed-shape mode (the torch runner's case). Logits of a row: a function of its token and position, plus a term of the number of rows
    it was computed among (a kernel chosen by shape). `fixed`: at a fixed shape those terms
    agree (a correct fixed mode), or not (one that leaks the shape anyway)."""

    def __init__(self, fixed_exact: bool = True) -> None:
        self.info = SimpleNamespace(backend="double", n_ctx=4096)
        self.decode_rows = 0
        self.fixed_exact = fixed_exact
        self.calls: list[int] = []

    def forward(self, spans):
        out = []
        for s in spans:
            n = len(s.tokens)
            shape = n
            if self.decode_rows and s.n_logits == n <= self.decode_rows:
                shape = self.decode_rows + (0 if self.fixed_exact else n)
            self.calls.append(shape)
            rows = [np.sin(np.arange(8, dtype=np.float32) * (t + 1) + p) + 1e-3 * shape
                    for t, p in zip(s.tokens, range(s.start_pos, s.start_pos + n))]
            out.append(np.stack(rows[n - s.n_logits:]).astype(np.float32))
        return out

    def truncate(self, slot: int, n: int) -> None:
        pass


def memo(overhead: float):
    """A probe memo that measures exactness and gives the step cost: a plain step 10 ms."""
    def call(name, inputs, measure, kind):
        if name == "fixed-step-cost":
            return StepCost(0.010, 0.010 * overhead, 7)
        return measure()
    return call


class ShapedRunner(ModelessRunner):
    """... with the fixed-shape mode."""

    def set_decode_rows(self, rows: int) -> None:
        self.decode_rows = rows


IDS = list(range(3, 1100))


def plain_exactness():
    from appliance.engine.spec.probe import check_exact
    return check_exact(ShapedRunner(), 0, IDS[:252], k=8)


def test_the_double_is_inexact_plain_and_exact_at_a_fixed_shape():
    from appliance.engine.spec.probe import check_exact
    plain = plain_exactness()
    assert not plain.exact and plain.max_abs_diff > 0
    r = ShapedRunner()
    r.set_decode_rows(ROWS)
    assert check_exact(r, 0, IDS[:100], k=ROWS - 1).exact
    # the verify's last step fills its KV window (256 cells, then 1,024) to the last cell
    assert positions(ROWS) == (247, 1015) and 247 + 2 * ROWS - 1 == 256


def test_the_policy_declines_a_dear_fixed_shape_and_says_why():
    """This CPU: 5 rows cost ~2.5 steps. Declined for that before its exactness is probed (the
    probe would cost the start for nothing); speculation stays off with both findings in the
    reason, and /health's decode_shape gives the measured cost."""
    r = ShapedRunner()
    plain = plain_exactness()
    shape, ex, cost = fixed_shape("auto", ROWS, r, IDS, memo(2.5), plain)
    assert ex is None and cost is None and r.decode_rows == 0          # left plain
    assert not r.calls                                                 # no exactness probe ran
    assert shape.mode == "plain" and shape.exact is None and shape.overhead == 2.5 and shape.why.startswith("declined")
    assert shape.why.endswith("(its exactness not probed)")
    policy = spec.decide("auto", False, plain, spec.CostModel(), shape=shape)
    assert not policy.allowed and "differs from one-token steps" in policy.reason and shape.why in policy.reason
    report = policy.as_dict()["decode_shape"]
    assert report["mode"] == "plain" and report["rows"] == ROWS and report["overhead"] == 2.5
    assert report["plain_step_ms"] == 10.0 and report["fixed_step_ms"] == 25.0
    with pytest.raises(ValueError, match="costs 2.50 plain steps"):   # --speculate lookup refuses, saying so
        spec.decide("lookup", False, plain, spec.CostModel(), shape=shape)


def test_the_policy_chooses_a_cheap_fixed_shape():
    """A memory-bound device: the spare rows cost 2%. Chosen: the runner stays at the shape,
    lookup drafts at most rows - 1 tokens, never closer to the context's end than its spare rows."""
    r = ShapedRunner()
    plain = plain_exactness()
    shape, ex, cost = fixed_shape("auto", ROWS, r, IDS, memo(1.02), plain)
    assert shape.mode == "fixed" and ex.exact and r.decode_rows == ROWS and shape.why.startswith("chosen")
    assert cost(1) == cost(ROWS) == cost(3 * ROWS) == 1.0     # a draft adds no rows to a fixed-shape step
    policy = spec.decide("auto", False, ex, cost, shape=shape)
    assert policy.allowed and policy.default == "lookup" and policy.k_max == ROWS - 1 and policy.pad == ROWS - 1
    assert f"at a fixed shape of {ROWS} rows" in policy.reason
    assert policy.as_dict()["decode_shape"]["mode"] == "fixed"
    sp = spec.Speculator(policy)
    st = sp.start(list(range(50)) * 2, "lookup")
    assert sp.propose([st], [100], [0]) == [tuple(range(ROWS - 1))]   # a long match, cut to 4 tokens
    assert sp.propose([st], [ROWS], [0]) == [(0,)]                    # 5 of room less the 4 spare rows
    assert sp.propose([st], [ROWS - 1], [0]) == [()]


def test_forced_on_uses_a_dear_shape_that_is_exact_and_off_never_probes():
    r = ShapedRunner()
    plain = plain_exactness()
    shape, ex, _ = fixed_shape("on", ROWS, r, IDS, memo(2.5), plain)
    assert shape.mode == "fixed" and ex.exact and shape.why.startswith("--fixed-shape on, though")
    r = ShapedRunner()
    shape, ex, _ = fixed_shape("off", ROWS, r, IDS, memo(1.0), plain)
    assert shape.mode == "plain" and shape.rows == 0 and ex is None and not r.calls


def test_a_fixed_shape_that_is_not_exact_is_declined_with_its_difference():
    r = ShapedRunner(fixed_exact=False)
    plain = plain_exactness()
    shape, ex, _ = fixed_shape("on", ROWS, r, IDS, memo(1.0), plain)
    assert ex is None and r.decode_rows == 0 and shape.exact is False and "not exact either" in shape.why
    assert shape.max_abs_diff > 0
    policy = spec.decide("auto", False, plain, spec.CostModel(), shape=shape)
    assert not policy.allowed and "not exact either" in policy.reason


def test_an_exact_runner_or_one_without_the_mode_is_not_probed():
    exact = spec.Exactness(True, 0.0, 0, 9)
    r = ShapedRunner()
    assert fixed_shape("auto", ROWS, r, IDS, memo(1.0), exact)[0].why == "the plain verify is exact" and not r.calls
    shape, ex, _ = fixed_shape("auto", ROWS, ModelessRunner(), IDS, memo(1.0), plain_exactness())
    assert "has no fixed-shape mode" in shape.why and ex is None
    assert DecodeShape().as_dict()["mode"] == "plain"


@pytest.mark.parametrize("overhead,pays", [(1.0, True), (1.05, True), (1.06, False), (1.68, False), (2.46, False)])
def test_fixed_shape_pays_only_where_a_stream_without_drafts_loses_at_most_the_margin(overhead, pays):
    ok, why = fixed_shape_pays(overhead, ROWS)
    assert ok is pays and why.startswith("chosen" if pays else "declined")
    assert f"{overhead:.2f} plain steps" in why
    assert not fixed_shape_pays(1.0, 2, prior=0.04)[0]          # a draft that would hardly ever be accepted


def test_spans_reach_the_double_as_asked():
    r = ShapedRunner()
    (rows,) = r.forward([Span(0, (1, 2, 3), 0, 3)])
    assert rows.shape == (3, 8)


class WindowedRunner(ShapedRunner):
    """... whose fixed-shape rows also depend on llama.cpp's KV window: the cells a forward fills
    (its spare rows included) rounded up to 256, as lavapipe's kernels do from 1,024 cells. Its
    greedy choice steps through a cycle of 8 tokens by 2 in windows of an odd count of 256
    cells and by 1 in the others, so a row computed in another window than its step's is seen."""

    kv_window = 256

    def forward(self, spans):
        out = []
        for s in spans:
            n = len(s.tokens)
            used = s.start_pos + max(n, self.decode_rows)
            odd = (-(-used // 256)) % 2
            rows = np.zeros((n, 8), np.float32)
            for i, t in enumerate(s.tokens):
                rows[i, (t + 1) % 8] = 1.0
                rows[i, (t + 2) % 8] = 0.5 + 0.75 * odd
            out.append(rows[n - s.n_logits:])
        return out


def decode(runner, policy, prompt, n_gen, speculate: bool) -> tuple[list[int], int]:
    """Greedy tokens after `prompt` as the scheduler makes them (a step, or a verify of a lookup
    draft starting where the step would), and the drafted tokens accepted."""
    sp = spec.Speculator(policy)
    st = sp.start(prompt, "lookup") if speculate else None
    (out,) = runner.forward([Span(0, tuple(prompt), 0, 1)])
    toks = [int(out[-1].argmax())]
    while len(toks) < n_gen:
        start = len(prompt) + len(toks) - 1
        draft = sp.propose([st], [n_gen - len(toks) - 1], [0], [start])[0] if st is not None else ()
        (rows,) = runner.forward([Span(0, (toks[-1], *draft), start, 1 + len(draft))])
        got = [int(r.argmax()) for r in rows]
        n = next((i for i in range(len(draft)) if got[i] != draft[i]), len(draft))
        new = got[:n + 1][:n_gen - len(toks)]
        if st is not None:
            sp.verified(st, len(new), new)
            st.index.extend(new)
        toks += new
    return toks, sp.stats().draft_accepted


def test_a_draft_stops_at_the_kv_windows_edge_so_every_row_is_computed_in_its_steps_window():
    """A fixed-shape forward at p fills cells to p + rows: a verify at p is computed in the
    window of p + rows and the step at p + j in that of p + j + rows. Drafts stop where those
    differ, so on a runner whose rows depend on the window the output equals the steps' across
    the edges at 256, 512 and 768 cells; without the rule it does not."""
    r = WindowedRunner()
    shape, ex, cost = fixed_shape("auto", ROWS, r, IDS, memo(1.0), plain_exactness())
    assert shape.mode == "fixed" and shape.window == 256 and ex.exact        # probed at 247 and 1,015
    policy = spec.decide("auto", False, ex, cost, shape=shape)
    assert policy.window == 256
    assert [policy.draft_room(100, at) for at in (246, 247, 248, 251, 252, 507)] == [4, 4, 3, 0, 4, 0]
    assert spec.Policy(k_max=4).draft_room(100, 251) == 4                     # a plain policy: no window
    with pytest.raises(ValueError, match="needs their positions"):
        sp = spec.Speculator(policy)
        sp.propose([sp.start([1, 2, 3] * 9, "lookup")], [10], [0])
    prompt = [i % 8 for i in range(200)]
    serial, _ = decode(r, policy, prompt, 600, speculate=False)
    spec_toks, accepted = decode(r, policy, prompt, 600, speculate=True)
    assert accepted > 300 and spec_toks == serial
    unruled, accepted = decode(r, replace(policy, window=0), prompt, 600, speculate=True)
    assert accepted > 300 and unruled != serial
