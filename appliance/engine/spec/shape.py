"""The decode shape speculation runs at, decided at start (`fixed_shape`): where the runner's
k-row verify differs from its one-row steps (llama.cpp's plain mode), a fixed shape of K rows
for every decode-family forward (runners/llamacpp_fixed.py) may make it exact by construction.
The probes prove that (the same bit-for-bit comparison as `probe.check_exact`, both sides at the
fixed shape, up to the last cell of llama.cpp's KV window) and measure what a
fixed-shape step costs against a plain one, side by side; `cost.fixed_shape_pays` decides."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from ..probe_memo import digest as _digest
from ..runners.base import ModelRunner, Span
from .cost import CostModel, fixed_shape_pays
from .policy import DecodeShape, Exactness
from .probe import check_exact

log = logging.getLogger("appliance.engine")

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class StepCost:
    """One-row steps after the same prompt, plain and at the fixed shape, alternated: medians."""

    plain_s: float
    fixed_s: float
    repeats: int

    @property
    def overhead(self) -> float:
        return self.fixed_s / self.plain_s if self.plain_s > 0 else float("inf")


def measure_step_cost(runner: ModelRunner, slot: int, prompt: Sequence[int], rows: int,
                      repeats: int = 7) -> StepCost:
    """A one-row step after `prompt`, plain and at `rows` rows, alternated in every repeat (the
    machine drifts); the slot is left empty and the runner plain."""
    runner.truncate(slot, 0)
    runner.forward([Span(slot, tuple(prompt), 0, 1)])
    n, tok = len(prompt), int(prompt[-1])
    times: dict[int, list[float]] = {0: [], rows: []}
    try:
        for _ in range(repeats + 1):   # the first of each is a warm-up: new graph shapes
            for r in (0, rows):
                runner.set_decode_rows(r)
                t0 = time.perf_counter()
                runner.forward([Span(slot, (tok,), n, 1)])
                times[r].append(time.perf_counter() - t0)
                runner.truncate(slot, n)
    finally:
        runner.set_decode_rows(0)
        runner.truncate(slot, 0)
    return StepCost(float(np.median(times[0][1:])), float(np.median(times[rows][1:])), repeats)


def positions(rows: int, window: int = 256) -> tuple[int, ...]:
    """Prompt lengths for the fixed-shape check: the last step among the verify's rows fills its
    KV window to the last cell (the verify a draft may make nearest a window's edge,
    `Policy.draft_room`), at one window and at four (lavapipe's kernels change there)."""
    return tuple(w - 2 * rows + 1 for w in (window, 4 * window))


def fixed_shape(setting: str, rows: int, runner: ModelRunner, ids: Sequence[int], memo: Callable,
                plain: Exactness) -> tuple[DecodeShape, Exactness | None, CostModel | None]:
    """Probe the fixed shape where it may help (`setting` auto: the plain verify is inexact; on:
    always) and decide. Returns the shape, and where it is chosen the fixed-shape exactness and
    cost model speculation then uses (the runner is left at that shape), else Nones (the
    runner left plain)."""
    if setting == "off":
        return DecodeShape(setting=setting, why="--fixed-shape off"), None, None
    if setting == "auto" and plain.exact:
        return DecodeShape(setting=setting, why="the plain verify is exact"), None, None
    if not hasattr(runner, "set_decode_rows"):
        return DecodeShape(setting=setting, why=f"the {runner.info.backend} runner has no fixed-shape mode"), None, None
    try:
        runner.set_decode_rows(rows)
    except ValueError as e:
        return DecodeShape(setting=setting, rows=rows, why=str(e)), None, None
    runner.set_decode_rows(0)
    # the cost first: where the spare rows cost more than the margin, auto declines whatever the
    # exactness, and its probe (prompts of ~250 and ~1,000 tokens) would cost the start for nothing
    step = memo("fixed-step-cost", {"prompt": _digest(ids[:48]), "rows": rows},
                lambda: measure_step_cost(runner, 0, ids[:48], rows), StepCost)
    shape = DecodeShape("plain", setting, rows, None, None, round(step.overhead, 3),
                        round(step.plain_s * 1e3, 3), round(step.fixed_s * 1e3, 3))
    pays, why = fixed_shape_pays(step.overhead, rows)
    if not pays and setting == "auto":
        return _said(shape, why + " (its exactness not probed)"), None, None
    runner.set_decode_rows(rows)
    exactness = None
    window = getattr(runner, "kv_window", 0)
    for at in positions(rows, window or 256):
        n = max(1, min(at, runner.info.n_ctx - 2 * rows))
        exactness = memo("verify-exactness-fixed", {"prompt": _digest(ids[:n]), "rows": rows},
                         lambda: check_exact(runner, 0, ids[:n], k=rows - 1), Exactness)
        if not exactness.exact or n < at:
            break
    assert exactness is not None
    shape = replace(shape, exact=exactness.exact, max_abs_diff=exactness.max_abs_diff, window=window)
    if not exactness.exact:
        runner.set_decode_rows(0)
        why = (f"a fixed shape of {rows} rows is not exact either (max |logit difference| "
               f"{exactness.max_abs_diff:.3g}, argmax differs at {exactness.argmax_differs} of {exactness.positions} rows)")
        return _said(shape, why), None, None
    chosen = replace(shape, mode="fixed", why=why if pays else f"--fixed-shape on, though {why.split(': ', 1)[-1]}")
    log.info("decode shape: fixed at %d rows (%s)", rows, chosen.why)
    # in the fixed shape a verify of up to rows - 1 drafted tokens costs what a step costs
    return chosen, exactness, CostModel((1, rows), (1.0, 1.0), step.fixed_s)


def _said(shape: DecodeShape, why: str) -> DecodeShape:
    log.info("decode shape: plain (%s)", why)
    return replace(shape, why=why)
