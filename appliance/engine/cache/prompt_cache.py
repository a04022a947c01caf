"""The prompt cache: one owner for every tier a prompt's KV can be found in.

    slot tier   a finished request's slot keeps the KV of its prompt (`kept`)
    RAM tier    kept positions saved with the runner's `save` when their slot is needed (ram.py)
    disk tier   the same states as files that survive a restart (disk.py)

The scheduler asks it twice in a request's life: `admit` when the request takes a slot (which
free slot, and how many of its prompt's positions are already there, restored from a tier if
one beats every slot), and `release` when it ends (what its slot keeps). Between requests the
engine calls `persist_one` (write-behind to disk while idle), and llama-server's slot actions
(slot_files.py) `export`, `load` and `erase` an idle slot's state whole.

How much of a shared prefix is reused is the grid's (grid.py): on a runner proven at start to
compute any chunk of at least m rows as the grid does (invariance.py), to the token, leaving m
tokens to compute; otherwise in whole grid blocks. Either way the rest is prefilled as a cold
run prefills, so a hit gives exactly the cold answer. Positions computed by one-token decode
steps (an earlier reply) are never reused exactly: a cold run would compute them in a chunk.
(Two-row decode steps, the last token again beside the new one, would give a reply a chunk's
KV; on llama.cpp here such a step cost 1.5-1.8x a one-row step, more than the recompute.)

Replies are settled while idle: a request that ends leaves its reply's tokens with its slot, and
while no request waits the engine recomputes them in chunks the runner was proven to compute as
a cold prompt's (`settle_one`, SETTLE_ROWS rows a call, at least m), so the next turn, which
resends the reply, reuses it exactly, as llama-server reuses it inexactly. Only with reuse to the
token proven (m > 0) and in the default mode; a request that arrives meanwhile waits for at most
one piece, and takes whatever was settled so far.

`--prompt-cache fast` (opt-in) reuses to the token as llama-server does, replies included:
each state then knows how many of its leading positions are exact (`exact`), and a request
that reused more than exact reuse would have is labelled inexact in its timings.

A slot's KV is computed under its request's LoRA adapter set (engine/lora.py), which the cache
keeps beside it (`kept_lora`): a request reuses a slot's prefix only under the same set, and only
the base model's states (the empty set) go to the RAM and disk tiers or are settled while idle,
so a state never crosses adapters and the tiers' keys stay token chains.

A spill costs the step path only the runner's `save` (the llama.cpp context is not
thread-safe, so it stays on the engine thread): the RAM tier keeps the very bytes it returns,
and the disk tier queues the same object for its writer thread (disk.py). At shutdown
`persist` hands every idle slot to that writer and waits, bounded, until it has written them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from ...config import EngineConfig
from ..grid import Grid, common_prefix
from ..lora import BASE, LoraSet
from ..runners.base import ModelRunner, Span
from ..stats import CacheStats
from .cost import PrefillCost
from . import kvfile
from .disk import DiskTier
from .ram import RamTier, index_block

log = logging.getLogger("appliance.prefix_cache")

PERSIST_TIMEOUT_S = 45.0   # at shutdown (the server gives the engine 60 s to stop)
# rows per piece of a reply settled while idle: the time a request arriving meanwhile may wait
# (llama.cpp here, SmolLM2-135M, 2 threads: 8 rows 37 ms at depth 2,000 and 46 ms at 4,400, at
# 4.7-5.8 ms a row, against 4.6-5.6 for 16 rows, 8.6-12.2 for 2 and 3.8-4.9 for 64)
SETTLE_ROWS = 8


MODES = ("on", "off", "fast")


@dataclass(frozen=True)
class Placement:
    slot: int
    reuse: int             # leading prompt positions already in the slot's KV
    inexact: bool = False  # --prompt-cache fast reused more than exact reuse would have
    exact: int = 0         # then: how many leading positions of the KV are still exact


class PromptCache:
    def __init__(self, runner: ModelRunner, grid: Grid, mode: str = "on", ram_bytes: int = 0,
                 disk: DiskTier | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"prompt cache mode must be one of {', '.join(MODES)}, not {mode!r}")
        n = runner.info.n_slots
        self.runner, self.grid, self.mode = runner, grid, mode
        self.enabled = mode != "off"
        self.kept: list[list[int]] = [[] for _ in range(n)]   # the positions each idle slot holds
        self.exact = [0] * n                                  # ... of which the first n are exact
        self.kept_lora: list[LoraSet] = [BASE] * n            # ... computed under this adapter set
        self.on_disk = [False] * n                            # kept positions already checked/written
        self.unsettled: list[list[int]] = [[] for _ in range(n)]  # tokens past `kept` to settle while idle
        self.busy: set[int] = set()
        self.prefill_cost = PrefillCost()
        self.ram = (RamTier(ram_bytes, index_block(grid.chunk), self.prefill_cost)
                    if self.enabled and ram_bytes > 0 else None)
        self.disk = disk if self.enabled else None
        if self.disk is not None:
            self.disk.cost = self.prefill_cost  # disk eviction values entries by the same measured rates
        self.hit_tokens = self.inexact_hits = self.settled_tokens = self.evicted = 0

    @classmethod
    def from_config(cls, runner: ModelRunner, cfg: EngineConfig, disk: DiskTier | None = None,
                    grid: Grid | None = None) -> PromptCache:
        return cls(runner, grid or Grid(cfg.prefill_chunk), cfg.prompt_cache, cfg.cache_ram_bytes, disk)

    # -- a request's life ----------------------------------------------------------------
    def admit(self, prompt: Sequence[int], use_cache: bool, free: Sequence[int],
              room: int | None = None, lora: LoraSet = BASE) -> Placement:
        """Give a request one of the `free` slots: the one keeping the longest reusable prefix
        of `prompt`, or a longer one restored from RAM or disk (one of at most `room` positions:
        what a shared KV pool has free for it). What the slot kept beyond that is saved to the
        tiers first; its KV is cut to the reused prefix. `lora`: the adapter set it runs under."""
        use = self.enabled and use_cache
        slot, at = self._pick_slot(prompt, use, free, lora)
        self._spill(slot, at.reuse)
        if use and lora == BASE:   # the tiers hold the base model's states only
            at = self._restore_saved(prompt, slot, at, room)
        self.kept_lora[slot] = lora
        self.runner.truncate(slot, at.reuse)
        self.kept[slot], self.unsettled[slot] = [], []  # the slot is rewritten from position `reuse` on
        self.busy.add(slot)
        self.hit_tokens += at.reuse
        self.inexact_hits += at.inexact
        return at

    def release(self, slot: int, prompt: Sequence[int], n_past: int, pin: bool = False,
                output: Sequence[int] = (), exact: int | None = None, settle: bool = False) -> None:
        """A request left `slot` with `n_past` positions computed (its prompt, then `output`):
        keep what a later request may reuse, and save it pinned into both tiers if it asked
        (`cache_pin`). `exact`: the request itself reused inexactly, and only that many leading
        positions are exact. `settle`: its reply is worth settling while idle (it ended, it was
        not cancelled)."""
        self.busy.discard(slot)
        n_exact = self.grid.keepable(n_past, len(prompt))
        if exact is not None:
            n_exact = min(n_exact, exact)
        if self.mode == "fast":
            self.kept[slot] = (list(prompt) + list(output))[:n_past]
        else:
            self.kept[slot] = list(prompt[:n_exact])
            if settle and output and self.mode == "on" and self.grid.any_position and not self.kept_lora[slot]:
                room = self.runner.info.n_ctx - n_exact  # a reply cut off by the context ends there
                rest = (list(prompt[n_exact:]) + list(output))[:room]
                self.unsettled[slot] = rest if n_exact + len(rest) >= self.grid.min_chunk else []
        self.exact[slot] = n_exact
        self.on_disk[slot] = False
        if pin:
            self._pin(slot)

    def pick(self, prompt: Sequence[int], use_cache: bool, free: Sequence[int], lora: LoraSet = BASE) -> int:
        """The slot among `free` that `admit` would give this prompt."""
        return self._pick_slot(prompt, self.enabled and use_cache, free, lora)[0]

    def planned(self, slot: int) -> int:
        """Positions an idle slot is to hold: its kept prompt and the reply still to settle."""
        return len(self.kept[slot]) + len(self.unsettled[slot])

    def evict(self, slot: int) -> None:
        """Empty an idle slot's KV, whose cells a request needs (a shared pool, sched/kv_pool.py):
        what it kept goes to the RAM and disk tiers first, as when a request overwrites it."""
        self._spill(slot, 0)
        self._empty(slot)
        self.evicted += 1

    # -- a slot's state whole: llama-server's slot save, restore and erase (slot_files.py) -------
    @property
    def fingerprint(self) -> str:
        """What a state saved from this cache is valid under (`kvfile.fingerprint`)."""
        return kvfile.fingerprint(self.runner.kv_fingerprint(), self.grid.chunk, self.grid.min_chunk)

    def export(self, slot: int) -> tuple[list[int], int, bytes]:
        """An idle slot's kept positions, how many of them are exact, and their state (a reply's
        decode KV past them dropped first, as a spill drops it; its settling is not disturbed)."""
        assert slot not in self.busy, "export of a busy slot"
        kept = list(self.kept[slot])
        self.runner.truncate(slot, len(kept))
        return kept, self.exact[slot], self.runner.save(slot) if kept else b""

    def load(self, slot: int, tokens: Sequence[int], exact: int, blob: bytes) -> None:
        """Put a saved state into an idle slot, which then keeps it: the next request whose prompt
        starts with `tokens` reuses them (`admit` picks the slot as any other's). What the slot
        kept before goes to the RAM and disk tiers first, as when a request overwrites it. A
        runner that refuses the state (it raises) leaves the slot empty."""
        assert slot not in self.busy, "load into a busy slot"
        self._spill(slot, 0)
        self._empty(slot)
        if tokens:
            try:
                self.runner.restore(slot, blob)
            except Exception:
                self.runner.truncate(slot, 0)
                raise
        self.kept[slot], self.exact[slot] = list(tokens), max(0, min(exact, len(tokens)))

    def erase(self, slot: int) -> int:
        """Empty an idle slot, forgetting what it kept (not saved to the tiers); how many
        positions it kept."""
        assert slot not in self.busy, "erase of a busy slot"
        n = len(self.kept[slot])
        self._empty(slot)
        return n

    def _empty(self, slot: int) -> None:
        self.runner.truncate(slot, 0)
        self.kept[slot], self.unsettled[slot], self.exact[slot], self.on_disk[slot] = [], [], 0, False

    def forget(self) -> None:
        """The runner failed: trust no KV in any slot."""
        self.kept = [[] for _ in self.kept]
        self.unsettled = [[] for _ in self.kept]
        self.exact = [0] * len(self.kept)
        self.busy.clear()

    def observe_prefill(self, start_pos: int, n_tokens: int, ms: float) -> None:
        """A clean measurement (one chunk alone in a step), for the value of entries."""
        self.prefill_cost.observe(start_pos, n_tokens, ms)

    # -- replies settled while idle ----------------------------------------------------------
    @property
    def settling(self) -> bool:
        """Whether an idle slot has reply tokens left to settle."""
        return any(rest and i not in self.busy for i, rest in enumerate(self.unsettled))

    def settle_one(self) -> int:
        """Compute the next piece of one idle slot's reply as a prompt chunk, on top of its kept
        positions (the reply's one-token decode KV is dropped first), and keep it: the count of
        tokens settled, 0 when nothing is left. At least m rows a piece, the last one included: a
        reply shorter than m is computed with the kept positions before it, which compute as
        they did. A runner failure drops that slot's reply and keeps what was settled (less
        those kept positions)."""
        m = self.grid.min_chunk
        rows = max(SETTLE_ROWS, 2 * m)
        for slot, rest in enumerate(self.unsettled):
            if not rest or slot in self.busy:   # the pieces leave none shorter than m
                continue
            n = len(rest) if len(rest) <= rows else rows if len(rest) - rows >= m else len(rest) - m
            kept = self.kept[slot]
            start = len(kept) - max(0, m - n)   # a reply shorter than m: kept positions again (they compute alike)
            self.runner.truncate(slot, start)
            try:
                self.runner.forward([Span(slot, tuple(kept[start:]) + tuple(rest[:n]), start, 1)])
            except Exception:
                log.exception("prompt cache: settling slot %d's reply failed; it is not kept", slot)
                self.runner.truncate(slot, start)
                self.kept[slot], self.exact[slot], self.unsettled[slot] = kept[:start], start, []
                return 0
            self.kept[slot] = self.kept[slot] + rest[:n]
            self.exact[slot] = len(self.kept[slot])
            self.unsettled[slot], self.on_disk[slot] = rest[n:], False
            self.settled_tokens += n
            return n
        return 0

    # -- write-behind --------------------------------------------------------------------
    def persist(self, timeout_s: float = PERSIST_TIMEOUT_S) -> bool:
        """Save every idle slot's kept blocks to disk (at shutdown: they survive the restart)
        and wait at most `timeout_s` until they are written; False when time ran out first."""
        if self.disk is None or not self.disk.enabled:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._persist_next(wait_s=deadline - time.monotonic()):
            pass
        if self.disk.drain(max(0.0, deadline - time.monotonic())):
            return True
        log.warning("prompt cache: %.0f s were not enough to write every idle slot's state to disk; "
                    "the rest is not kept", timeout_s)
        return False

    def persist_one(self) -> bool:
        """Hand one idle slot's kept blocks to the disk tier if they are not there yet (the
        engine calls this while idle, so little is left to write at shutdown); only while the
        disk writer has nothing queued, so idle ticks keep one state in flight, not every
        slot's. False when nothing was handed over."""
        if self.disk is None or not self.disk.enabled or self.disk.queued_bytes:
            return False
        return self._persist_next(wait_s=0.0)

    def _persist_next(self, wait_s: float) -> bool:
        for i, kept in enumerate(self.kept):
            if i in self.busy or not kept or self.on_disk[i] or self.kept_lora[i]:
                continue
            self.on_disk[i] = True  # the engine asks every idle tick: hash a slot's blocks once
            if not self.disk.holds(kept):
                self.runner.truncate(i, len(kept))
                self.disk.put(kept, self.runner.save(i), wait_s=wait_s, exact=self.exact[i])
                return True
        return False

    def close(self) -> None:
        """Stop the disk tier's writer (after `persist`, at shutdown)."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> CacheStats:
        ram = self.ram.stats() if self.ram is not None else {}
        disk = self.disk.stats() if self.disk is not None else {}
        idle = [i for i in range(len(self.kept)) if i not in self.busy]
        saving = self.disk is not None and self.disk.enabled
        return CacheStats(cached_tokens=sum(len(k) for k in self.kept), cache_hit_tokens=self.hit_tokens,
                          inexact_hits=self.inexact_hits, settled_tokens=self.settled_tokens,
                          unsettled_tokens=sum(len(self.unsettled[i]) for i in idle),
                          unsaved_slots=sum(bool(self.kept[i]) and not self.on_disk[i] for i in idle) if saving else 0,
                          **ram, **disk)

    # -- inside ----------------------------------------------------------------------------
    def _place(self, slot: int, prompt: Sequence[int], shared: int, exact: int) -> Placement:
        """What a request may reuse of a state sharing `shared` leading positions with its
        prompt, the first `exact` of which are exact: exact reuse (the grid's rule), or in fast
        mode to the token, labelled inexact when that is more."""
        n = len(prompt)
        reuse = self.grid.reusable(min(shared, exact), n)
        fast = min(shared, n - 1)
        if self.mode == "fast" and fast > reuse and fast >= self.grid.min_reuse:
            return Placement(slot, fast, True, min(fast, exact))
        return Placement(slot, reuse)

    def _pick_slot(self, prompt: Sequence[int], use: bool, free: Sequence[int],
                   lora: LoraSet) -> tuple[int, Placement]:
        """The free slot with the longest reusable prefix under the same adapter set; without a
        hit, the one keeping least."""
        best: Placement | None = None
        for i in free:
            same = use and self.kept_lora[i] == lora
            at = self._place(i, prompt, common_prefix(self.kept[i], prompt), self.exact[i]) if same else Placement(i, 0)
            if best is None or at.reuse > best.reuse or (
                    at.reuse == best.reuse and len(self.kept[i]) < len(self.kept[best.slot])):
                best = at
        return best.slot, best

    def _restore_saved(self, prompt: Sequence[int], slot: int, at: Placement, room: int | None) -> Placement:
        """Restore the state sharing the longest prefix (RAM, then disk) if it beats the slot's own
        (and holds at most `room` positions)."""
        found, entry = self.ram.lookup(prompt) if self.ram is not None else (0, None)
        if entry is not None and (room is None or len(entry.tokens) <= room):
            got = self._place(slot, prompt, found, entry.exact)
            if got.reuse > at.reuse:
                self.runner.restore(slot, entry.blob)
                self.ram.record_hit(got.reuse)
                return got
        def beats(shared: int, exact: int) -> bool:
            return self._place(slot, prompt, shared, exact).reuse > at.reuse

        found, tokens, blob, exact = self.disk.lookup(prompt, beats) if self.disk is not None else (0, (), None, 0)
        if blob is not None and (room is None or len(tokens) <= room):
            got = self._place(slot, prompt, found, exact)
            if got.reuse > at.reuse:
                self.runner.restore(slot, blob)
                self.disk.record_hit(got.reuse)
                if self.ram is not None:
                    self.ram.put(tokens, blob, exact=exact)
                return got
        return at

    def _spill(self, slot: int, reuse: int) -> None:
        """Positions kept in a slot that is about to be overwritten go to the RAM and disk tiers,
        unless the request reuses all but fewer than `min_reuse` of them: they stay in the slot
        but for those few, which a later request wanting them recomputes for less than a reuse
        is worth, while a save copies the whole state on this request's way to its first token
        (a settled reply the next turn resends changed: ~100 ms at 1,800 positions here)."""
        kept = self.kept[slot]
        if not kept or len(kept) - reuse < self.grid.min_reuse or self.kept_lora[slot]:
            return
        want_ram = self.ram is not None and not self.ram.holds(kept)
        want_disk = self.disk is not None and self.disk.enabled and not self.disk.holds(kept)
        if not (want_ram or want_disk):
            return
        self.runner.truncate(slot, len(kept))  # drop what is not kept (a reply, outside fast mode)
        blob = self.runner.save(slot)
        if want_ram:
            self.ram.put(kept, blob, exact=self.exact[slot])
        if want_disk:
            self.disk.put(kept, blob, exact=self.exact[slot])

    def _pin(self, slot: int) -> None:
        """Save the slot's kept positions into both tiers now, pinned: a system prompt with
        tool schemas stays cached whatever else comes through."""
        kept = self.kept[slot]
        if not kept or (self.ram is None and self.disk is None) or self.kept_lora[slot]:
            return
        self.runner.truncate(slot, len(kept))  # drop what is not kept (a reply, outside fast mode)
        blob = self.runner.save(slot)
        if self.ram is not None:
            self.ram.put(kept, blob, pin=True, exact=self.exact[slot])
        if self.disk is not None:
            self.disk.put(kept, blob, pin=True, exact=self.exact[slot])
