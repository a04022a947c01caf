"""The scheduler's prompt-cache bookkeeping for its slots: which free slot a request takes
(the longest kept prefix), what is saved to the RAM and disk tiers when a slot is overwritten
or pinned, and the write-behind to disk while idle. A mixin of `Scheduler`, which owns the
state it reads (`slots`, `kept`, `on_disk`, `ram`, `disk`, `runner`, `cfg`); split out only
to keep the scheduling step readable on its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .scheduler import Active


class SlotCache:
    runner: Any
    cfg: Any
    slots: list
    kept: list[list[int]]
    on_disk: list[bool]
    ram: Any
    disk: Any

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

    def persist(self) -> None:
        """Save every idle slot's kept blocks to disk (at shutdown: they survive the restart)."""
        while self.persist_one():
            pass

    def persist_one(self) -> bool:
        """Write one idle slot's kept blocks to disk if they are not there yet (the engine calls
        this while idle, so little is left to write at shutdown); False when nothing was left."""
        if self.disk is None or not self.disk.enabled:
            return False
        for i, act in enumerate(self.slots):
            if act is not None or not self.kept[i] or self.on_disk[i]:
                continue
            self.on_disk[i] = True  # the engine asks every idle tick: hash a slot's blocks once
            if not self.disk.holds(self.kept[i]):
                self.runner.truncate(i, len(self.kept[i]))
                self.disk.put(self.kept[i], self.runner.save(i))
                return True
        return False

    def _restore_saved(self, act: Active, slot: int, reuse: int) -> int:
        """Restore the longest saved prefix (RAM, then disk) if it beats the slot's own."""
        if not (self.cfg.prompt_cache and act.req.cache_prompt):
            return reuse
        limit = (len(act.prompt) - 1) // self.cfg.prefill_chunk * self.cfg.prefill_chunk
        found, entry = self.ram.lookup(act.prompt) if self.ram is not None else (0, None)
        if entry is not None and min(found, limit) > reuse:
            self.runner.restore(slot, entry.blob)
            self.ram.record_hit(min(found, limit))
            return min(found, limit)
        found, blob = self.disk.lookup(act.prompt) if self.disk is not None else (0, None)
        if blob is not None and min(found, limit) > reuse:
            self.runner.restore(slot, blob)
            self.disk.record_hit(min(found, limit))
            if self.ram is not None:
                self.ram.put(act.prompt[:found], blob)
            return min(found, limit)
        return reuse

    def _pick_slot(self, act: Active) -> tuple[int, int]:
        """The free slot with the longest reusable prefix (whole blocks, never the prompt's last
        token, whose logits are needed); without a hit, the free slot keeping the least."""
        chunk = self.cfg.prefill_chunk
        best, best_reuse = -1, -1
        for i, occupant in enumerate(self.slots):
            if occupant is not None:
                continue
            reuse = 0
            if self.cfg.prompt_cache and act.req.cache_prompt:
                reuse = min(common_prefix(self.kept[i], act.prompt), len(act.prompt) - 1) // chunk * chunk
            if reuse > best_reuse or (reuse == best_reuse and len(self.kept[i]) < len(self.kept[best])):
                best, best_reuse = i, reuse
        return best, best_reuse


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share. Slices compare in C, and the usual answer (all
    of the shorter, or all but a few at the end) is found in a few of them: the draft model
    asks this of a whole context on every drafting step."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo], and the first difference is before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
