"""What the loaded runner can do, measured on it at engine start: whether a k-row verify equals
k one-row steps bit for bit (`check_exact`, which decides whether speculation may change the
output; see speculator.py), and what a forward of m decode rows costs (`measure_costs`, which
the drafting arithmetic weighs)."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..runners.base import ModelRunner, Span
from .cost import CostModel
from .policy import Exactness


def check_exact(runner: ModelRunner, slot: int, prompt: Sequence[int], k: int = 8) -> Exactness:
    """Do k + 1 rows verified in one forward equal k + 1 one-row steps, bit for bit? Prefill
    `prompt` in `slot`, decode k tokens one by one (greedy), then feed the same tokens again as
    one span and compare every row. The slot is left empty."""
    runner.truncate(slot, 0)
    (out,) = runner.forward([Span(slot, tuple(prompt), 0, 1)])
    toks, steps = [int(np.argmax(out[-1]))], []
    for i in range(k + 1):
        (row,) = runner.forward([Span(slot, (toks[-1],), len(prompt) + i, 1)])
        steps.append(row[0])
        toks.append(int(np.argmax(row[0])))
    runner.truncate(slot, len(prompt))
    (rows,) = runner.forward([Span(slot, tuple(toks[:k + 1]), len(prompt), k + 1)])
    runner.truncate(slot, 0)
    serial = np.stack(steps)
    diff = float(np.abs(rows - serial).max())
    differs = int((rows.argmax(-1) != serial.argmax(-1)).sum())
    return Exactness(bool(np.array_equal(rows, serial)), diff, differs, k + 1)


COST_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def measure_costs(runner: ModelRunner, slot: int, prompt: Sequence[int],
                  rows: Sequence[int] = COST_ROWS, repeats: int = 5) -> CostModel:
    """c(m) on the loaded model: the median time of a forward of m rows after `prompt`, over
    the median time of one row. The slot is left empty. Every row count up to 6 is measured:
    a kernel's cost can step between two of them (torch's CPU int4 matmul takes rows four at a
    time: 5 rows cost 1.8-2.1 one-row steps here where 4 cost 1.24-1.37), which interpolating
    between 4 and 8 would hide."""
    runner.truncate(slot, 0)
    runner.forward([Span(slot, tuple(prompt), 0, 1)])
    n = len(prompt)
    times: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(repeats):
        for m in rows:  # alternate the sizes inside every repeat: the machine drifts
            t0 = time.perf_counter()
            runner.forward([Span(slot, tuple(prompt[:m]), n, m)])
            times[m].append(time.perf_counter() - t0)
            runner.truncate(slot, n)
    runner.truncate(slot, 0)
    one = float(np.median(times[rows[0]]))
    return CostModel(tuple(rows), tuple(float(np.median(times[m])) / one for m in rows), one)
