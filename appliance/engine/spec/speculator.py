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

Drafts come from prompt lookup (`lookup.NgramIndex`): the most recent earlier occurrence of the
context's last n tokens (longest n first) in the request's prompt and output, and what
followed it. Or from a draft model (`draft.DraftModel`): a second, smaller model with the same
vocabulary, decoding greedily in its own KV kept in step with the target's. Or from the served
model's own multi-token-prediction head (`mtp.MtpDrafter`, llama.cpp's MTP context), which
drafts the same way from the trunk's hidden rows. A server has at most one of the two model
drafters; a request's mode says which source ("lookup", or the drafter's "draft" or "mtp":
then prompt lookup's draft is its other option, taken on a step where it promises more); the
verify is the same.

Whether to draft, and how far, is arithmetic on measured costs (`cost.CostModel`): a forward of
m rows costs c(m) one-row steps (`probe.measure_costs`, on the loaded model at start). With acceptance
probability a per drafted token (tracked per request), a draft of k commits
E(k) = (1 - a^(k+1)) / (1 - a) tokens for c(1 + k); serial commits 1 for c(1) = 1. A request
drafts the k that maximises E(k) / c(1 + k), and only when that beats 1 by a margin. A draft
model's k tokens cost k of its own forwards on top: u * c_d(1) each, u being its one-row
forward's time over the target's (`cost.DraftCost`, measured at start with the acceptance prior:
how often the draft's argmax equals the target's on a sample text).

Several streams: a step's cost is c(total rows), plus u * sum_j c_d(n_j) when draft-model
streams draft (n_j of them are still drafting at their j-th token: the draft model decodes
them together). The scheduler gives drafts to streams in order of their expected gain and
keeps one only while (tokens committed) / cost of the whole step improves on the step without
it: batching already amortises the weights over the streams, and a draft that would make a
shared step slower than the tokens it adds is dropped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

from ...errors import InvalidRequest
from ..stats import SpeculationStats
from .cost import PRIOR_ACCEPT, Acceptance, plan_options
from .draft import DraftModel
from .lookup import NgramIndex
from .policy import Policy

log = logging.getLogger("appliance.scheduler")


@dataclass
class Drafting:
    """One request's drafting state: its context (indexed for prompt lookup) and record. A
    request in "draft" mode also takes prompt lookup's draft, free, on a step where that
    promises more (copying: quoted code, tool-call arguments); `lookup_acc` is its record."""

    index: NgramIndex
    mode: str = "lookup"           # "lookup", or "draft" / "mtp": the model drafter and prompt lookup
    acc: Acceptance = field(default_factory=Acceptance)
    lookup_acc: Acceptance = field(default_factory=Acceptance)
    draft: tuple[int, ...] = ()
    by_model: bool = False         # the current draft is the draft model's

    def totals(self) -> tuple[int, int]:
        """Drafted and accepted tokens over both sources."""
        extra = self.lookup_acc if self.mode in MODEL_MODES else Acceptance()
        return self.acc.proposed + extra.proposed, self.acc.accepted + extra.accepted


MODEL_MODES = ("draft", "mtp")   # the modes drafted by a model (the draft model, the MTP head)


class Speculator:
    """Speculation for the scheduler, which asks it twice per step: `propose` before the forward
    (each decoding stream's draft, or none) and `after_forward` after it (the draft model
    follows the target's prefill and learns its relative cost); `verified` after each verify."""

    def __init__(self, policy: Policy | None = None, drafter: DraftModel | None = None) -> None:
        self.policy = policy or Policy()
        self.drafter = drafter
        self.model_mode = getattr(drafter, "mode", "draft")   # the mode its drafts serve
        self.counts = SpeculationStats()

    def start(self, prompt: Sequence[int], mode: str | None) -> Drafting | None:
        """A new request's drafting state (None: it decodes serially). A mode this engine cannot
        serve is refused with the reason (a 400)."""
        mode = mode or self.policy.default
        refused = self.policy.refusal(mode)
        if refused:
            raise InvalidRequest(f"speculate: {refused}", param="speculate")
        if mode == "off":
            return None
        prior = self.policy.draft.prior if mode == self.model_mode and self.policy.draft else PRIOR_ACCEPT
        return Drafting(NgramIndex(prompt), mode, Acceptance(prior=prior))

    def label(self, st: Drafting | None) -> str:
        """What a response reports in timings.speculation."""
        return self.policy.label(st.mode) if st is not None else "off"

    def propose(self, states: Sequence[Drafting | None], room: Sequence[int],
                slots: Sequence[int], starts: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        """The draft for each decode stream of a step (empty for none), also left in its state.
        Lookup proposals come from each stream's context first (a lookup draft goes only as far
        as its proposal); options and lengths by `plan_options` on the measured costs; then the
        draft model decodes the drafts of its streams together. `room[i]` is how many drafted
        tokens stream i can still use (its max_tokens and context left, less one); `slots[i]`
        its slot, for the draft model; `starts[i]` the position its verify starts at (where
        the policy keeps a verify inside one KV window, `Policy.draft_room`)."""
        if all(st is None for st in states):  # the usual step of a server that is not drafting
            return [()] * len(states)
        if starts is None:
            if self.policy.window:
                raise ValueError("a policy that keeps verifies in one KV window needs their positions")
            starts = [0] * len(states)
        props, options = self._options(states, room, starts)
        drafter = self.drafter
        if drafter is not None and hasattr(drafter, "streams"):   # the MTP head keeps these streams' rows
            drafter.streams([s for st, s in zip(states, slots) if st is not None and st.mode == self.model_mode])
        draft_cost = drafter.cost if drafter is not None and drafter.cost is not None else self.policy.draft
        out: list[tuple[int, ...]] = [()] * len(states)
        asks = []
        for i, (o, k) in enumerate(plan_options(options, self.policy.cost, draft_cost)):
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
                if not d:   # no evidence this step: the record drifts back to the prior
                    st.acc.idle()
                    st.lookup_acc.idle()
        return out

    def _options(self, states: Sequence[Drafting | None], room: Sequence[int],
                 starts: Sequence[int]) -> tuple[list, list]:
        """Each stream's lookup proposal and the drafts it could take: (acceptance, longest
        draft, by the draft model)."""
        props, options = [], []
        for st, r, at in zip(states, room, starts):
            room_k = self.policy.draft_room(r, at)
            prop = st.index.propose(room_k) if st is not None and room_k else ()
            props.append(prop)
            if st is None:
                options.append([])
            elif st.mode == self.model_mode and self.drafter is not None:
                options.append([(st.acc.rate, room_k, True)]
                               + ([(st.lookup_acc.rate, len(prop), False)] if prop else []))
            else:
                options.append([(st.acc.rate, len(prop), False)])
        return props, options

    def after_forward(self, seconds: float, rows: int, decode_only: bool,
                      prefilled: Sequence[tuple[int, Sequence[int]]]) -> None:
        """The target's forward took `seconds` for `rows` rows. On an all-decode step the draft
        model compares its own drafting time with it; it prefills the prompt chunks the target
        just took (`prefilled`: (slot, the prompt up to the chunk's end) of draft-mode streams)."""
        if self.drafter is None:
            return
        if decode_only:  # a clean measure of the draft model's cost against the target's
            self.drafter.observe(seconds, self.policy.cost(rows))
        self.drafter.last = None
        self.drafter.follow(prefilled)

    def verified(self, st: Drafting, used: int, committed: Sequence[int]) -> int:
        """After a verify that used `used` rows and committed these tokens: acceptance counts.
        Returns the accepted draft tokens."""
        k = len(st.draft)
        accepted = next((i for i in range(min(used, k)) if committed[i] != st.draft[i]), min(used, k))
        (st.lookup_acc if st.mode in MODEL_MODES and not st.by_model else st.acc).update(k, accepted)
        c = self.counts
        self.counts = replace(c, spec_steps=c.spec_steps + 1, draft_proposed=c.draft_proposed + k,
                              draft_accepted=c.draft_accepted + accepted, spec_committed=c.spec_committed + used)
        st.draft = ()
        return accepted

    def reset(self) -> None:
        """The runner failed: the draft model's KV is trusted no more than the target's."""
        if self.drafter is not None:
            try:
                self.drafter.reset()
            except Exception:  # the draft model may be what failed
                log.exception("resetting the draft model failed")

    def stats(self) -> SpeculationStats:
        return self.counts
