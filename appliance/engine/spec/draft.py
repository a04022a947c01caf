"""The draft model: a second, smaller model with the target's vocabulary that proposes drafts
for the target to verify (`appliance serve --draft-model PATH`).

Design
------
The draft model is any `ModelRunner` (llama.cpp or torch, `--draft-engine`) with the target's
slots and context. Its KV is kept in step with the target's: `have[slot]` is the token
sequence whose KV the draft holds in that slot, and every call first brings it to the
request's context by the longest common prefix (a truncate) and a catch-up of what is
missing, fed on the same prefill grid as the target's prefill. After a
verify, the accepted draft tokens are already in the draft's KV and the rejected ones are cut
by the next call's common prefix; a new request in a slot reuses whatever prefix the slot's
last request shares with it, as the target's prompt cache does. The draft follows the
target's prompt chunks as they are prefilled (`follow`), so a long prompt does not stall the
first decode step of its stream.

Drafting is greedy (argmax, lowest id on ties) and decodes the drafting streams together:
the first forward carries each stream's catch-up (usually the one token the target committed
last, two when a whole draft was accepted) and gives every stream its first draft token; the
j-th forward carries one token for each stream still drafting. The draft model's numerics
never matter to the output, which the target's verify decides: they only move acceptance.

The vocabularies must agree: the same pieces for every id the two share, and at most
MAX_VOCAB_DIFFERENCE ids more on either side (a draft token the target does not have ends the
draft). `agreement` measures, at start, how often the draft's argmax equals the target's on a
sample text: the acceptance prior of a request that has not drafted yet.

What a draft costs against the target changes with depth (the two runners' attention grows
at other rates) and with the machine's load, so the start-up ratio is only where `cost`
starts: every step whose forward is all decode rows (drafting streams' verifies among them)
compares the draft model's time with the target's and moves `cost.unit` towards what it saw
(`observe`, an exponential average).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from ...errors import ModelLoadError
from ..grid import Grid, common_prefix
from ..runners.base import ModelRunner, Span
from .cost import DraftCost

UNIT_WEIGHT = 0.3            # how far one observed step moves the draft/target time ratio

MAX_VOCAB_DIFFERENCE = 128   # as llama.cpp's speculative example allows (padding rows)

SAMPLE = ("Bread is one of the oldest prepared foods. Evidence from 30,000 years ago in Europe "
          "shows starch residue on rocks used for pounding plants. During the Neolithic period, "
          "grain became a staple, and people learned to let dough rise by leaving it in the warm "
          "air. The Egyptians used the foam from beer to leaven their loaves, which made them "
          "lighter. Today, bakers choose between yeast, sourdough starters and chemical agents "
          "such as baking soda, and each gives the crumb its own texture and taste.")


def check_vocab(draft: ModelRunner, target: ModelRunner, name: str) -> None:
    """Refuse a draft model whose tokens are not the target's (ModelLoadError naming the first
    difference): its drafts would be other text under the same ids."""
    n_d, n_t = draft.info.n_vocab, target.info.n_vocab
    if abs(n_d - n_t) > MAX_VOCAB_DIFFERENCE:
        raise ModelLoadError(f"--draft-model {name}: its vocabulary has {n_d} tokens and the served "
                             f"model's {n_t}; a draft model must share the served model's tokenizer")
    for i in range(min(n_d, n_t)):
        a, b = draft.detokenize([i]), target.detokenize([i])
        if a != b:
            raise ModelLoadError(f"--draft-model {name}: token {i} is {a!r} there and {b!r} in the "
                                 "served model; a draft model must share the served model's tokenizer")


class ModelDrafter:
    """What a draft model and the MTP head (mtp.py) share: per slot, the tokens whose entries
    their KV holds, cut to a request's context by the longest common prefix; and their cost
    against the target's, kept current by what each all-decode step shows (`observe`)."""

    def __init__(self, n_slots: int) -> None:
        self.have: list[list[int]] = [[] for _ in range(n_slots)]
        self.cost: DraftCost | None = None      # set once measured; `observe` keeps it current
        self.last: tuple[float, tuple[int, ...]] | None = None  # the last propose: seconds, lengths

    def _cut(self, slot: int, tokens: Sequence[int], want_logits: bool, truncate) -> int:
        """Cut the slot's KV (`truncate(slot, n)`) to its common prefix with `tokens`, all but
        the last token with `want_logits` (fed again for its logits); returns what is kept."""
        have = self.have[slot]
        p = common_prefix(have, tokens)
        if want_logits:
            p = min(p, len(tokens) - 1)
        if p < len(have):
            truncate(slot, p)
            del have[p:]
        return p

    def observe(self, verify_s: float, verify_cost: float) -> None:
        """After the target's forward that verified the last drafts (and nothing but decode
        rows): `verify_s` seconds for what the cost model calls `verify_cost` one-row steps."""
        if self.last is None or self.cost is None or verify_s <= 0:
            return
        (draft_s, ks), self.last = self.last, None
        forwards = self.cost(ks) / self.cost.unit if self.cost.unit > 0 else 0.0  # in draft one-row steps
        if forwards <= 0 or draft_s <= 0:
            return
        seen = (draft_s / forwards) / (verify_s / verify_cost)
        self.cost = dataclasses.replace(self.cost, unit=(1 - UNIT_WEIGHT) * self.cost.unit + UNIT_WEIGHT * seen)


class DraftModel(ModelDrafter):
    def __init__(self, runner: ModelRunner, n_vocab_target: int, grid: Grid) -> None:
        super().__init__(runner.info.n_slots)
        self.runner = runner
        self.n_vocab = min(n_vocab_target, runner.info.n_vocab)
        self.grid = grid

    # -- keeping the KV in step ----------------------------------------------------------
    def _catch_up(self, slot: int, tokens: Sequence[int], want_logits: bool) -> Span | None:
        """Cut the slot's KV to its common prefix with `tokens` and run every grid chunk but the
        last of what is missing; returns the last piece as a span (None: nothing to run). With
        `want_logits` the last token is always in it, so it yields the next token's logits."""
        have = self.have[slot]
        p = self._cut(slot, tokens, want_logits, self.runner.truncate)
        while len(tokens) - p > 0:
            end = self.grid.chunk_end(p, len(tokens))
            span = Span(slot, tuple(tokens[p:end]), p, 1 if want_logits and end == len(tokens) else 0)
            if end == len(tokens):
                return span
            self.runner.forward([span])
            have.extend(span.tokens)
            p = end
        return None

    def follow(self, work: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Prefill along with the target: bring each (slot, tokens) into the draft's KV."""
        spans = [s for s in (self._catch_up(slot, toks, False) for slot, toks in work) if s is not None]
        if spans:
            self.runner.forward(spans)
            for s in spans:
                self.have[s.slot].extend(s.tokens)

    def reset(self) -> None:
        """Forget every slot's KV (the target failed under it: start again from nothing)."""
        for slot in range(len(self.have)):
            self.runner.truncate(slot, 0)
            self.have[slot] = []

    # -- drafting ------------------------------------------------------------------------
    def propose(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Greedy drafts of k tokens for each (slot, context, k), decoded together. The context
        ends with the token the target feeds next; the draft continues it."""
        t0 = time.perf_counter()
        spans = [self._catch_up(slot, ctx, True) for slot, ctx, _ in asks]
        out: list[list[int]] = [[] for _ in asks]
        live = list(range(len(asks)))
        while live:
            rows = self.runner.forward([spans[i] for i in live])
            still = []
            for i, row in zip(live, rows):
                self.have[asks[i][0]].extend(spans[i].tokens)
                tok = int(np.argmax(row[-1]))
                if tok >= self.n_vocab:
                    continue  # a token the target does not have: the draft ends here
                out[i].append(tok)
                if len(out[i]) < asks[i][2]:
                    still.append(i)
                    spans[i] = Span(asks[i][0], (tok,), len(self.have[asks[i][0]]), 1)
            live = still
        self.last = (time.perf_counter() - t0, tuple(k for *_, k in asks))
        return [tuple(d) for d in out]

    def agreement(self, target: ModelRunner, slot: int, prompt: Sequence[int]) -> float:
        """How often the draft's argmax equals the target's over `prompt`, teacher-forced (the
        target's slot and the draft's are left empty)."""
        n = len(prompt)
        target.truncate(slot, 0)
        self.runner.truncate(slot, 0)
        self.have[slot] = []
        (t,) = target.forward([Span(slot, tuple(prompt), 0, n)])
        (d,) = self.runner.forward([Span(slot, tuple(prompt), 0, n)])
        target.truncate(slot, 0)
        self.runner.truncate(slot, 0)
        return float(np.mean(t[:, :self.n_vocab].argmax(-1) == d[:, :self.n_vocab].argmax(-1)))

    def close(self) -> None:
        self.runner.close()
