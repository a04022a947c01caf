"""The prompt cache: one owner for every tier a prompt's KV can be found in.

    slot tier   a finished request's slot keeps the KV of its prompt's whole grid blocks (`kept`)
    RAM tier    kept blocks saved with the runner's `save` when their slot is needed (ram.py)
    disk tier   the same states as files that survive a restart (disk.py)

The scheduler asks it twice in a request's life: `admit` when the request takes a slot (which
free slot, and how many of its prompt's positions are already there, restored from a tier if
one beats every slot), and `release` when it ends (what its slot keeps). Between requests the
engine calls `persist_one` (write-behind to disk while idle). Reuse is always in whole blocks
of the prefill grid and never the prompt's last token, and the rest is prefilled on the same
grid a cold run uses, so a hit gives exactly the cold answer. Positions computed by one-token
decode steps (an earlier reply) are never kept: a cold run would compute them in a chunk.

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
from ..runners.base import ModelRunner
from ..stats import CacheStats
from .cost import PrefillCost
from .disk import DiskTier
from .ram import RamTier

log = logging.getLogger("appliance.prefix_cache")

PERSIST_TIMEOUT_S = 45.0   # at shutdown (the server gives the engine 60 s to stop)


@dataclass(frozen=True)
class Placement:
    slot: int
    reuse: int      # leading prompt positions already in the slot's KV


class PromptCache:
    def __init__(self, runner: ModelRunner, grid: Grid, enabled: bool = True, ram_bytes: int = 0,
                 disk: DiskTier | None = None) -> None:
        n = runner.info.n_slots
        self.runner, self.grid, self.enabled = runner, grid, enabled
        self.kept: list[list[int]] = [[] for _ in range(n)]   # reusable prompt blocks per slot
        self.on_disk = [False] * n                            # kept blocks already checked/written
        self.busy: set[int] = set()
        self.prefill_cost = PrefillCost()
        self.ram = RamTier(ram_bytes, grid.chunk, self.prefill_cost) if enabled and ram_bytes > 0 else None
        self.disk = disk if enabled else None
        if self.disk is not None:
            self.disk.cost = self.prefill_cost  # disk eviction values entries by the same measured rates
        self.hit_tokens = 0

    @classmethod
    def from_config(cls, runner: ModelRunner, cfg: EngineConfig, disk: DiskTier | None = None) -> PromptCache:
        return cls(runner, Grid(cfg.prefill_chunk), cfg.prompt_cache, cfg.cache_ram_bytes, disk)

    # -- a request's life ----------------------------------------------------------------
    def admit(self, prompt: Sequence[int], use_cache: bool, free: Sequence[int]) -> Placement:
        """Give a request one of the `free` slots: the one keeping the longest reusable prefix
        of `prompt`, or a longer one restored from RAM or disk. What the slot kept beyond that
        is saved to the tiers first; its KV is cut to the reused prefix."""
        use = self.enabled and use_cache
        slot, reuse = self._pick_slot(prompt, use, free)
        self._spill(slot, reuse)
        if use:
            reuse = self._restore_saved(prompt, slot, reuse)
        self.runner.truncate(slot, reuse)
        self.kept[slot] = []  # the slot is being rewritten from position `reuse` on
        self.busy.add(slot)
        self.hit_tokens += reuse
        return Placement(slot, reuse)

    def release(self, slot: int, prompt: Sequence[int], n_past: int, pin: bool = False) -> None:
        """A request left `slot` with `n_past` positions computed: keep its prompt's whole
        blocks, and save them pinned into both tiers if it asked (`cache_pin`)."""
        self.busy.discard(slot)
        self.kept[slot] = list(prompt[: self.grid.floor(min(n_past, len(prompt)))])
        self.on_disk[slot] = False
        if pin:
            self._pin(slot)

    def forget(self) -> None:
        """The runner failed: trust no KV in any slot."""
        self.kept = [[] for _ in self.kept]
        self.busy.clear()

    def observe_prefill(self, start_pos: int, n_tokens: int, ms: float) -> None:
        """A clean measurement (one chunk alone in a step), for the value of entries."""
        self.prefill_cost.observe(start_pos, n_tokens, ms)

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
            if i in self.busy or not kept or self.on_disk[i]:
                continue
            self.on_disk[i] = True  # the engine asks every idle tick: hash a slot's blocks once
            if not self.disk.holds(kept):
                self.runner.truncate(i, len(kept))
                self.disk.put(kept, self.runner.save(i), wait_s=wait_s)
                return True
        return False

    def close(self) -> None:
        """Stop the disk tier's writer (after `persist`, at shutdown)."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> CacheStats:
        ram = self.ram.stats() if self.ram is not None else {}
        disk = self.disk.stats() if self.disk is not None else {}
        return CacheStats(cached_tokens=sum(len(k) for k in self.kept), cache_hit_tokens=self.hit_tokens,
                          **ram, **disk)

    # -- inside ----------------------------------------------------------------------------
    def _pick_slot(self, prompt: Sequence[int], use: bool, free: Sequence[int]) -> tuple[int, int]:
        """The free slot with the longest reusable prefix; without a hit, the one keeping least."""
        best, best_reuse = -1, -1
        for i in free:
            reuse = self.grid.reusable(common_prefix(self.kept[i], prompt), len(prompt)) if use else 0
            if reuse > best_reuse or (reuse == best_reuse and len(self.kept[i]) < len(self.kept[best])):
                best, best_reuse = i, reuse
        return best, best_reuse

    def _restore_saved(self, prompt: Sequence[int], slot: int, reuse: int) -> int:
        """Restore the longest saved prefix (RAM, then disk) if it beats the slot's own."""
        found, entry = self.ram.lookup(prompt) if self.ram is not None else (0, None)
        usable = self.grid.reusable(found, len(prompt))
        if entry is not None and usable > reuse:
            self.runner.restore(slot, entry.blob)
            self.ram.record_hit(usable)
            return usable
        found, blob = self.disk.lookup(prompt) if self.disk is not None else (0, None)
        usable = self.grid.reusable(found, len(prompt))
        if blob is not None and usable > reuse:
            self.runner.restore(slot, blob)
            self.disk.record_hit(usable)
            if self.ram is not None:
                self.ram.put(prompt[:found], blob)
            return usable
        return reuse

    def _spill(self, slot: int, reuse: int) -> None:
        """Blocks kept in a slot that is about to be overwritten go to the RAM and disk tiers."""
        kept = self.kept[slot]
        if not kept or len(kept) <= reuse:
            return
        want_ram = self.ram is not None and not self.ram.holds(kept)
        want_disk = self.disk is not None and self.disk.enabled and not self.disk.holds(kept)
        if not (want_ram or want_disk):
            return
        self.runner.truncate(slot, len(kept))  # drop the reply's positions: not reusable
        blob = self.runner.save(slot)
        if want_ram:
            self.ram.put(kept, blob)
        if want_disk:
            self.disk.put(kept, blob)

    def _pin(self, slot: int) -> None:
        """Save the slot's kept blocks into both tiers now, pinned: a system prompt with tool
        schemas stays cached whatever else comes through."""
        kept = self.kept[slot]
        if not kept or (self.ram is None and self.disk is None):
            return
        self.runner.truncate(slot, len(kept))  # the reply's positions are not reusable
        blob = self.runner.save(slot)
        if self.ram is not None:
            self.ram.put(kept, blob, pin=True)
        if self.disk is not None:
            self.disk.put(kept, blob, pin=True)
