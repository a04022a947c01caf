"""Drafts from the served model's own multi-token-prediction (next-n) head
(`--speculate mtp`, or `auto` on a model that has one, in its GGUF or an `mtp-*.gguf` sidecar;
see runners/llamacpp_mtp.py and runners/mtp_source.py).

Design
------
The head is one extra block: fed token x_p with the trunk's last hidden row at p - 1, h_{p-1},
it predicts x_{p+1} and returns its own hidden row, on which it predicts again. It has a KV
cache of its own (llama.cpp's MTP context), one stream per slot, which must hold an entry
(x_p, h_{p-1}) for every position of the request's context, as the target's KV holds x_p.

So the drafter keeps two things per slot:
  - `have[slot]`: the tokens whose entries the head's KV holds, each fed with the trunk's own
    row (never a drafted one), cut like the draft model's by the longest common prefix;
  - `rows[slot]`: the trunk's hidden rows by position, recorded after every target forward of
    a slot that drafts by MTP (`record`: a forward at position s makes rows past s stale),
    with `toks[slot]`, the tokens they were computed for. A row is used only where `toks`
    agrees with the request's context; elsewhere (a prefix the prompt cache restored instead
    of computing) the head sees zeros, as llama.cpp's driver does at position 0: that costs
    acceptance, never output. Rows the head's KV no longer needs are dropped.

Drafting, for the contexts of several streams together: the first forward carries, per
stream, the catch-up (the tokens committed since its last draft, usually 1 + accepted) paired
with the trunk's rows, and its last row gives draft token 1 and the head's hidden row; each
next forward carries one drafted token per stream still drafting, with the head's row before
it. Drafting is greedy (argmax, lowest id on ties). Afterwards the drafted entries are cut from
the head's KV (they were fed the head's rows, not the trunk's), so the next catch-up re-feeds
whatever the target accepted with the trunk's rows. The target's verify decides the output;
the head's numerics only move acceptance.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..grid import common_prefix
from ..runners.base import Span
from .cost import CostModel, DraftCost
from .draft import ModelDrafter

HEAD_COST_ROWS = (1, 2, 3, 4, 8, 16)


class MtpDrafter(ModelDrafter):
    """The model's MTP head as the speculator's drafter (the draft model's interface)."""

    mode = "mtp"

    def __init__(self, runner) -> None:
        n_slots = runner.info.n_slots
        super().__init__(n_slots)
        self.runner = runner            # a LlamaCppRunner with `nextn` and `hidden`
        self.head = runner.nextn
        self.toks: list[list[int]] = [[] for _ in range(n_slots)]
        self.rows: list[dict[int, np.ndarray]] = [{} for _ in range(n_slots)]
        self.slots: set[int] = set()    # the slots whose requests draft by MTP (recorded)
        for slot in range(n_slots):   # a new drafter (the engine upgraded) trusts no earlier entry
            self.head.truncate(slot, 0)

    # -- the trunk's rows ------------------------------------------------------------------
    def record(self, slots: set[int], prefixes: dict[int, Sequence[int]] | None = None) -> None:
        """Keep the trunk's rows of the last target forward for these slots. `prefixes`: the
        contexts of the prompt chunks just computed (slot: the prompt up to the chunk's end),
        whose KV below the chunk is the scheduler's for that request: where `toks` says
        otherwise (a prefix the prompt cache restored, or one never recorded), the rows there
        are dropped and the tokens taken from the context, so the rows computed now count."""
        prefixes = prefixes or {}
        for seq, pos, tok, h in self.runner.hidden:
            for slot in slots.intersection(seq.tolist()):
                sel = np.flatnonzero(seq == slot)
                start = int(pos[sel[0]])
                toks, rows = self.toks[slot], self.rows[slot]
                keep = start
                if slot in prefixes:
                    keep = common_prefix(toks[:start], prefixes[slot][:start])
                    toks[keep:] = prefixes[slot][keep:start]
                del toks[start:]
                toks.extend([-1] * (start - len(toks)))   # never seen: no context agrees there
                for p in [p for p in rows if p >= keep]:
                    del rows[p]
                for i in sel:
                    toks.append(int(tok[i]))
                    rows[int(pos[i])] = h[i]

    def _inputs(self, slot: int, ctx: Sequence[int], p: int, end: int) -> np.ndarray:
        """h_{q-1} for q in [p, end): the trunk's rows where they are the context's, else zeros."""
        valid = common_prefix(self.toks[slot], ctx)
        h = np.zeros((end - p, self.head.n_embd), np.float32)
        for q in range(max(p, 1), end):
            row = self.rows[slot].get(q - 1) if q - 1 < valid else None
            if row is not None:
                h[q - p] = row
        return h

    def _catch_up(self, slot: int, ctx: Sequence[int], want: bool):
        """Cut the slot's head KV to its common prefix with `ctx` and return the item that feeds
        the rest (None: nothing to feed). With `want` the last token is always fed, for logits."""
        p = self._cut(slot, ctx, want, self.head.truncate)
        if p >= len(ctx):
            return None
        return (slot, tuple(ctx[p:]), p, self._inputs(slot, ctx, p, len(ctx)), int(want))

    def _prune(self, slot: int) -> None:
        keep = len(self.have[slot]) - 1
        rows = self.rows[slot]
        for p in [p for p in rows if p < keep]:
            del rows[p]

    # -- the drafter's interface --------------------------------------------------------------
    def streams(self, slots: Sequence[int]) -> None:
        """The slots of this step's decoding streams that draft by MTP (their rows are kept)."""
        self.slots = set(slots)

    def follow(self, work: Sequence[tuple[int, Sequence[int]]]) -> None:
        """After a target forward: record the rows of MTP streams, then bring each (slot,
        prompt up to the chunk just prefilled) into the head's KV."""
        self.slots.update(slot for slot, _ in work)
        if self.slots:
            self.record(self.slots, dict(work))
        items = [it for it in (self._catch_up(slot, toks, False) for slot, toks in work) if it is not None]
        if items:
            self.head.forward(items)
            for slot, toks, *_ in items:
                self.have[slot].extend(toks)
                self._prune(slot)

    def propose(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Greedy drafts of k tokens for each (slot, context, k), decoded together; the context
        ends with the token the target feeds next."""
        t0 = time.perf_counter()
        items = [self._catch_up(slot, ctx, True) for slot, ctx, _ in asks]
        out: list[list[int]] = [[] for _ in asks]
        live = list(range(len(asks)))
        first = True
        while live:
            got = self.head.forward([items[i] for i in live])
            still = []
            for i, res in zip(live, got):
                slot, ctx, k = asks[i]
                if first:
                    self.have[slot].extend(items[i][1])
                logits, h = res
                tok = int(np.argmax(logits[-1]))
                out[i].append(tok)
                if len(out[i]) < k:
                    still.append(i)
                    items[i] = (slot, (tok,), len(ctx) + len(out[i]) - 1, h[-1:], 1)
            live, first = still, False
        for (slot, ctx, _), d in zip(asks, out):
            if len(d) > 1:   # entries fed with the head's own rows leave the KV
                self.head.truncate(slot, len(ctx))
            self._prune(slot)
        self.last = (time.perf_counter() - t0, tuple(k for *_, k in asks))
        return [tuple(d) for d in out]

    # -- measured at start ------------------------------------------------------------------
    def agreement(self, slot: int, prompt: Sequence[int]) -> float:
        """How often the head's argmax equals the target's over `prompt`, teacher-forced: at
        each position p >= 1 the head (x_p, trunk row p - 1) and the target (x_p) both predict
        x_{p+1}. The acceptance prior of a first drafted token; both KVs are left empty."""
        self._empty(slot)
        (target,) = self.runner.forward([Span(slot, tuple(prompt), 0, len(prompt))])
        self.record({slot})
        (head, _), = self.head.forward([self._catch_up(slot, prompt, False)[:4] + (len(prompt),)])
        self._empty(slot)
        return float(np.mean(head[1:].argmax(-1) == target[1:].argmax(-1)))

    def measure(self, slot: int, prompt: Sequence[int], target_unit_s: float, repeats: int = 5) -> DraftCost:
        """The head's c(m) after `prompt` and its one-row forward over the target's."""
        self._empty(slot)
        n = len(prompt)
        self.head.forward([(slot, tuple(prompt), 0, np.zeros((n, self.head.n_embd), np.float32), 0)])
        times: dict[int, list[float]] = {m: [] for m in HEAD_COST_ROWS}
        for _ in range(repeats):
            for m in HEAD_COST_ROWS:   # alternated inside every repeat: the machine drifts
                h = np.zeros((m, self.head.n_embd), np.float32)
                t0 = time.perf_counter()
                self.head.forward([(slot, tuple(prompt[:m]), n, h, 1)])
                times[m].append(time.perf_counter() - t0)
                self.head.truncate(slot, n)
        self._empty(slot)
        one = float(np.median(times[1]))
        cost = CostModel(HEAD_COST_ROWS, tuple(float(np.median(times[m])) / one for m in HEAD_COST_ROWS), one)
        return DraftCost(one / target_unit_s if target_unit_s > 0 else 1.0, cost)

    def _empty(self, slot: int) -> None:
        self.runner.truncate(slot, 0)
        self.head.truncate(slot, 0)
        self.have[slot], self.toks[slot], self.rows[slot] = [], [], {}

    def reset(self) -> None:
        for slot in range(len(self.have)):
            self.head.truncate(slot, 0)
            self.have[slot], self.toks[slot], self.rows[slot] = [], [], {}

    def close(self) -> None:
        """The head's context belongs to the runner, which frees it."""
