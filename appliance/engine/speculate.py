"""Speculative decoding that never changes the output.

Design
------
A decoding request may feed, instead of its last token alone, the last token followed by a
draft d1..dk: one forward returns k + 1 logits rows, and the scheduler samples them in order
exactly as it would sample k + 1 serial steps (same sampler, same random draws, same stop,
grammar and length checks), stopping at the first row whose token is not the draft's next.
Every committed token is the one serial decoding would have produced, provided row i's logits
equal those of the i-th serial step bit for bit. That is a property of the runner, which
`probe.check_exact` measures on the loaded model at start-up: where it does not hold, speculation is
refused unless the user opts in to inexact speculation, and then every response says so.

With greedy decoding this is the usual accept rule (accept while the argmax, lowest id on
ties, equals the draft; then the target's own token). With temperature > 0 it is exact in a
stronger sense than speculative sampling: the draft is a point mass, a row's token is drawn
with the request's own generator, and it is accepted when it equals the draft, so the output
is the serial output for the same seed, token for token.

Drafts come from prompt lookup (`NgramIndex`): the most recent earlier occurrence of the
context's last n tokens (longest n first) in the request's prompt and output, and what
followed it. Or from a draft model (`draft.DraftModel`): a second, smaller model with the same
vocabulary, decoding greedily in its own KV kept in step with the target's. A request's mode
says which ("lookup", or "draft": then prompt lookup's draft is its other option, taken on a
step where it promises more); the verify is the same.

Whether to draft, and how far, is arithmetic on measured costs (`CostModel`): a forward of
m rows costs c(m) one-row steps (`probe.measure_costs`, on the loaded model at start). With acceptance
probability a per drafted token (tracked per request), a draft of k commits
E(k) = (1 - a^(k+1)) / (1 - a) tokens for c(1 + k); serial commits 1 for c(1) = 1. A request
drafts the k that maximises E(k) / c(1 + k), and only when that beats 1 by a margin. A draft
model's k tokens cost k of its own forwards on top: u * c_d(1) each, u being its one-row
forward's time over the target's (`DraftCost`, measured at start with the acceptance prior:
how often the draft's argmax equals the target's on a sample text).

Several streams: a step's cost is c(total rows), plus u * sum_j c_d(n_j) when draft-model
streams draft (n_j of them are still drafting at their j-th token: the draft model decodes
them together). The scheduler gives drafts to streams in order of their expected gain and
keeps one only while (tokens committed) / cost of the whole step improves on the step without
it: batching already amortises the weights over the streams, and a draft that would make a
shared step slower than the tokens it adds is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .draft import DraftModel
    from .probe import Exactness

MIN_GAIN = 1.05         # a draft must promise 5% more tokens per unit of cost than no draft
PRIOR_ACCEPT = 0.5      # acceptance assumed for a request before it has drafted
PRIOR_WEIGHT = 2.0      # ... worth this many tried draft tokens
DECAY = 0.7             # per verify: copying comes in bursts, recent steps tell most
K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 15)


class NgramIndex:
    """The context of one request (prompt, then output as it grows), indexed by its n-grams for
    prompt lookup. `propose` never matches the context's own suffix."""

    def __init__(self, tokens: Sequence[int] = (), n_min: int = 1, n_max: int = 4) -> None:
        self.toks: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            end = len(self.toks)
            for n, m in self.maps.items():  # the n-grams ending here now have a continuation
                if end >= n:
                    m[tuple(self.toks[end - n:end])] = end
            self.toks.append(int(t))

    def propose(self, k: int) -> tuple[int, ...]:
        """What followed the most recent earlier occurrence of the longest matching suffix."""
        end = len(self.toks)
        for n in sorted(self.maps, reverse=True):
            if end < n:
                continue
            at = self.maps[n].get(tuple(self.toks[end - n:]))
            if at is not None:
                return tuple(self.toks[at:at + k])
        return ()


def expected_tokens(accept: float, k: int) -> float:
    """Tokens committed by one verify of a k-token draft when each drafted token is accepted
    with probability `accept`, independently: 1 + a + a^2 + ... + a^k."""
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


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
    verify, and a prior of PRIOR_ACCEPT worth PRIOR_WEIGHT tries holds while evidence is thin."""

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


@dataclass
class SpecStats:
    """Engine-wide counters for /metrics."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    committed: int = 0

    def as_dict(self) -> dict:
        return {"spec_steps": self.steps, "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "spec_committed": self.committed}


# -- the engine's policy and a request's drafting state --------------------------------------------

@dataclass(frozen=True)
class Policy:
    """What the engine decided at start: which requests draft, how, and on what measured costs."""

    default: str = "off"           # for requests that do not say: "lookup", "draft" or "off"
    modes: tuple[str, ...] = ()    # the modes a request may ask for
    inexact: bool = False          # the user allowed speculation on an inexact runner
    reason: str = "speculation is off (--speculate off)"
    cost: CostModel = field(default_factory=CostModel)
    exactness: Exactness | None = None
    k_max: int = 15
    draft: DraftCost | None = None  # the draft model's costs, when one is loaded

    @property
    def allowed(self) -> bool:
        return bool(self.modes)

    def label(self, mode: str) -> str:
        """What a response of this mode reports in timings.speculation."""
        return mode + "-inexact" if self.inexact and mode != "off" else mode

    def refusal(self, mode: str) -> str | None:
        """Why a request may not ask for `mode` (None: it may)."""
        if mode == "off" or mode in self.modes:
            return None
        if self.modes and mode == "draft":
            return "this server has no draft model (start it with --draft-model)"
        return self.reason

    def as_dict(self) -> dict:
        ex = self.exactness
        return {"default": self.default, "modes": list(self.modes), "allowed": self.allowed,
                "label": self.label(self.default), "reason": self.reason, "cost": self.cost.as_dict(),
                "exact": None if ex is None else ex.exact,
                "exact_max_abs_diff": None if ex is None else ex.max_abs_diff,
                "draft": None if self.draft is None else self.draft.as_dict()}


def decide(mode: str, inexact_ok: bool, exactness: Exactness | None, cost: CostModel,
           draft: DraftCost | None = None) -> Policy:
    """The policy for `--speculate mode` given what the start-up check measured (and the
    draft model's costs, when one is loaded)."""
    if mode == "off" or exactness is None:
        return Policy(reason="speculation is off (--speculate off)", cost=cost)
    modes = ("lookup", "draft") if draft is not None else ("lookup",)
    preferred = "draft" if draft is not None else "lookup"
    if exactness.exact:
        return Policy(preferred if mode == "auto" else mode, modes, False,
                      "the runner verifies k tokens exactly as k steps", cost, exactness, draft=draft)
    why = (f"this runner's {exactness.positions}-row verify differs from one-token steps (max "
           f"|logit difference| {exactness.max_abs_diff:.3g}, argmax differs at "
           f"{exactness.argmax_differs} of {exactness.positions} rows), so drafted tokens could "
           "change the output; start with --speculate-inexact to allow it anyway")
    if inexact_ok:
        return Policy(mode if mode != "auto" else "off", modes, True, why.split(", so")[0], cost,
                      exactness, draft=draft)
    if mode in ("lookup", "draft"):
        raise ValueError(f"--speculate {mode}: {why}")
    return Policy(reason=why, cost=cost, exactness=exactness)


@dataclass
class Drafting:
    """One request's drafting state: its context (indexed for prompt lookup) and record. A
    request in "draft" mode also takes prompt lookup's draft, free, on a step where that
    promises more (copying: quoted code, tool-call arguments); `lookup_acc` is its record."""

    index: NgramIndex
    mode: str = "lookup"           # "lookup", or "draft": the draft model and prompt lookup
    acc: Acceptance = field(default_factory=Acceptance)
    lookup_acc: Acceptance = field(default_factory=Acceptance)
    draft: tuple[int, ...] = ()
    by_model: bool = False         # the current draft is the draft model's

    def totals(self) -> tuple[int, int]:
        """Drafted and accepted tokens over both sources."""
        extra = self.lookup_acc if self.mode == "draft" else Acceptance()
        return self.acc.proposed + extra.proposed, self.acc.accepted + extra.accepted


def drafts(states: Sequence[Drafting | None], room: Sequence[int], policy: Policy,
           drafter: DraftModel | None = None, slots: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """The draft for each decode stream of a step (empty for none), also left in its state.
    Lookup proposals come from each stream's context first (a lookup draft goes only as far
    as its proposal); options and lengths by `plan_options` on the measured costs; then the
    draft model decodes the drafts of its streams together. `room[i]` is how many drafted
    tokens stream i can still use (its max_tokens and context left, less one); `slots[i]`
    its slot, for the draft model."""
    if all(st is None for st in states):  # the usual step of a server that is not drafting
        return [()] * len(states)
    props, options = [], []
    for st, r in zip(states, room):
        room_k = max(0, min(policy.k_max, r))
        prop = st.index.propose(room_k) if st is not None and room_k else ()
        props.append(prop)
        if st is None:
            options.append([])
        elif st.mode == "draft" and drafter is not None:
            options.append([(st.acc.rate, room_k, True)] + ([(st.lookup_acc.rate, len(prop), False)] if prop else []))
        else:
            options.append([(st.acc.rate, len(prop), False)])
    draft_cost = drafter.cost if drafter is not None and drafter.cost is not None else policy.draft
    plan = plan_options(options, policy.cost, draft_cost)
    out: list[tuple[int, ...]] = [()] * len(states)
    asks = []
    for i, (o, k) in enumerate(plan):
        if states[i] is None or not k:
            continue
        states[i].by_model = options[i][o][2]
        if states[i].by_model:
            asks.append((i, slots[i], states[i].index.toks, k))
        else:
            out[i] = props[i][:k]
    if asks:
        for (i, *_), got in zip(asks, drafter.propose([a[1:] for a in asks])):
            out[i] = got
    for st, d in zip(states, out):
        if st is not None:
            st.draft = d
    return out


def record(st: Drafting, stats: SpecStats, used: int, committed: Sequence[int]) -> int:
    """After a verify that used `used` rows and committed these tokens: acceptance counts.
    Returns the accepted draft tokens."""
    k = len(st.draft)
    accepted = next((i for i in range(min(used, k)) if committed[i] != st.draft[i]), min(used, k))
    (st.lookup_acc if st.mode == "draft" and not st.by_model else st.acc).update(k, accepted)
    stats.steps += 1
    stats.proposed += k
    stats.accepted += accepted
    stats.committed += used
    st.draft = ()
    return accepted
