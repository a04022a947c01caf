"""The arithmetic of drafting: what a verify of k drafted tokens is expected to commit, what a
forward of m rows costs (`CostModel`, measured at start by `probe.measure_costs`), what a draft
model's tokens cost (`DraftCost`), each request's acceptance record (`Acceptance`), and
`plan_options`, which chooses every stream's draft for one step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_GAIN = 1.05         # a draft must promise 5% more tokens per unit of cost than no draft
PRIOR_ACCEPT = 0.5      # acceptance assumed for a request before it has drafted
PRIOR_WEIGHT = 2.0      # ... worth this many tried draft tokens
DECAY = 0.7             # per verify: copying comes in bursts, recent steps tell most
K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 15)


def expected_tokens(accept: float, k: int) -> float:
    """Tokens committed by one verify of a k-token draft when each drafted token is accepted
    with probability `accept`, independently: 1 + a + a^2 + ... + a^k."""
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


def fixed_shape_pays(overhead: float, rows: int, prior: float = PRIOR_ACCEPT) -> tuple[bool, str]:
    """Whether decoding at a fixed shape of `rows` rows pays (spec/shape.py), from the measured
    `overhead`: a fixed-shape step's time over a plain step's. Every step pays it, drafted or not,
    and a draft of up to rows - 1 tokens then costs nothing more. So a stream that never drafts
    (free prose) may lose no more than the margin a draft must win by (MIN_GAIN), and one that
    drafts at the prior acceptance must gain that margin. (True or False, and why.)"""
    what = f"a fixed-shape step of {rows} rows costs {overhead:.2f} plain steps"
    if overhead > MIN_GAIN:
        return False, (f"declined: {what}: a stream without drafts would decode at {1 / overhead:.2f}x "
                       f"(at most {MIN_GAIN - 1:.0%} slower is allowed)")
    gain = expected_tokens(prior, rows - 1) / overhead
    if gain <= MIN_GAIN:
        return False, f"declined: {what}: a draft at acceptance {prior:.2f} would commit {gain:.2f}x"
    return True, f"chosen: {what}; a draft at acceptance {prior:.2f} commits up to {gain:.2f}x"


@dataclass
class CostModel:
    """c(m): the cost of a forward of m decode rows, in one-row steps, interpolated between the
    measured row counts (linear beyond the last)."""

    rows: tuple[int, ...] = (1,)
    cost: tuple[float, ...] = (1.0,)
    unit_s: float = 0.0          # the measured time of a one-row forward

    def __call__(self, m: int) -> float:
        if m <= self.rows[0]:
            return self.cost[0]
        if m >= self.rows[-1]:
            if len(self.rows) == 1:
                return self.cost[-1] * m
            slope = (self.cost[-1] - self.cost[-2]) / (self.rows[-1] - self.rows[-2])
            return self.cost[-1] + slope * (m - self.rows[-1])
        return float(np.interp(m, self.rows, self.cost))

    def as_dict(self) -> dict[str, float]:
        return {str(r): round(c, 3) for r, c in zip(self.rows, self.cost)}


@dataclass
class Acceptance:
    """A request's drafting record. Drafted tokens are tried in order until the first rejection,
    so a verify that accepted a of k tried a + 1 tokens (a if all passed): the acceptance
    probability per tried token is accepted / tried. Copying comes in bursts (a quoted file, a
    path, then new text), so the estimate weighs recent steps more: counts decay by DECAY per
    verify, and a prior of PRIOR_ACCEPT worth PRIOR_WEIGHT tries holds while evidence is thin.
    A step without a draft decays them too (`idle`): a request whose estimate fell too low to
    draft returns to the prior, so it tries again where the copying starts (without it, a
    stream that stopped drafting had no new evidence and never drafted again)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    recent_accepted: float = 0.0
    recent_tried: float = 0.0
    prior: float = PRIOR_ACCEPT

    def update(self, k: int, accepted: int) -> None:
        tried = accepted + (1 if accepted < k else 0)
        self.proposed, self.accepted, self.steps = self.proposed + k, self.accepted + accepted, self.steps + 1
        self.recent_accepted = DECAY * self.recent_accepted + accepted
        self.recent_tried = DECAY * self.recent_tried + tried

    def idle(self) -> None:
        """A step on which this request did not draft: what it last saw counts less."""
        self.recent_accepted *= DECAY
        self.recent_tried *= DECAY

    @property
    def rate(self) -> float:
        return ((self.recent_accepted + self.prior * PRIOR_WEIGHT)
                / (self.recent_tried + PRIOR_WEIGHT))


@dataclass(frozen=True)
class DraftCost:
    """What a draft model's tokens cost: `unit` is its one-row forward's time over the
    target's, `cost` its own c_d(m); `prior` the acceptance measured at start."""

    unit: float
    cost: CostModel
    prior: float = PRIOR_ACCEPT

    def __call__(self, ks: Sequence[int]) -> float:
        """The draft model's forwards for drafts of these lengths, decoded together, in target
        one-row steps: its j-th forward carries the streams drafting at least j tokens."""
        return self.unit * sum(self.cost(sum(1 for k in ks if k >= j)) for j in range(1, max(ks, default=0) + 1))

    def as_dict(self) -> dict:
        return {"unit": round(self.unit, 3), "cost": self.cost.as_dict(), "prior_accept": round(self.prior, 3)}


Option = tuple[float, int, bool]   # (acceptance rate, longest draft, drafted by the draft model)


def plan_options(options: Sequence[Sequence[Option]], cost: CostModel,
                 draft: DraftCost | None = None) -> list[tuple[int, int]]:
    """(option, draft length) for each decode stream of one step, from the drafts it could
    have (`options[i]`: none, prompt lookup's, the draft model's, or both; a draft model's
    tokens add its forwards to the step at `draft`'s cost). Streams are considered in order
    of the tokens their best full draft would promise; each takes the option and k that
    maximise the whole step's expected tokens per unit of cost, and only when that beats the
    step without it by MIN_GAIN."""
    n = len(options)
    ks, modelled, pick = [0] * n, [False] * n, [0] * n

    def step_cost(rows: int, ks: list[int], modelled: list[bool]) -> float:
        if draft is None:
            return cost(rows)
        return cost(rows) + draft([k for k, m in zip(ks, modelled) if m])

    def promise(i: int) -> float:
        return max((expected_tokens(a, m) for a, m, _ in options[i]), default=1.0)

    rows, tokens = n, float(n)
    for i in sorted(range(n), key=lambda i: -promise(i)):
        now = tokens / step_cost(rows, ks, modelled)
        best, best_rate = (0, 0), now
        for o, (accept, avail, by_model) in enumerate(options[i]):
            for k in K_CHOICES:
                if k > avail:
                    break
                rate = ((tokens - 1.0 + expected_tokens(accept, k))
                        / step_cost(rows + k, ks[:i] + [k] + ks[i + 1:], modelled[:i] + [by_model] + modelled[i + 1:]))
                if rate > best_rate:
                    best, best_rate = (o, k), rate
        o, k = best
        if k and best_rate > MIN_GAIN * now:
            pick[i], ks[i], modelled[i] = o, k, options[i][o][2]
            rows, tokens = rows + k, tokens - 1.0 + expected_tokens(options[i][o][0], k)
    return list(zip(pick, ks))


