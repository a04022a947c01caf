"""The RAM tier of the prompt cache: a byte-bounded store of saved sequence states.

When a slot whose kept blocks would be overwritten is taken, those blocks are saved with the
runner's `save` into this tier, keyed by a hash chain over grid blocks (vLLM's scheme: each
block's key hashes its parent's key and its tokens), so any request sharing a whole-block
prefix with a saved state finds it and restores instead of recomputing. Every block of an
entry is indexed, so a request that shares only part of an entry's prefix still hits (the
restore is then truncated).

Eviction is by value (`cost.value`). A request may pin its prompt (`cache_pin`: a system
prompt with tool schemas that every turn of an agent starts with): a pinned entry is never
evicted by value. Pins may hold at most `PIN_SHARE` of a tier; past that, the least recently
used pin becomes an ordinary entry.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..grid import Grid
from .cost import PrefillCost, value

log = logging.getLogger("appliance.prefix_cache")

PIN_SHARE = 0.5    # most of a tier's bytes that pinned entries may hold


def block_chain(tokens: Sequence[int], chunk: int) -> list[bytes]:
    """One key per whole block: key_k = H(key_{k-1} || tokens of block k)."""
    keys, parent = [], b""
    arr = np.asarray(tokens[: Grid(chunk).floor(len(tokens))], dtype=np.int64)
    for start in range(0, len(arr), chunk):
        parent = hashlib.blake2b(parent + arr[start:start + chunk].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class Entry:
    keys: list[bytes]            # the block chain of its tokens
    blob: bytes                  # the runner's saved state for exactly those blocks
    cost_ms: float = 0.0         # what recomputing it would take
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False

    def value(self, now: float) -> float:
        """Recompute milliseconds per byte, halved per HALF_LIFE_S unused."""
        return value(self.cost_ms, len(self.blob), now - self.last_used)

    @property
    def n_blocks(self) -> int:
        return len(self.keys)


class RamTier:
    def __init__(self, max_bytes: int, chunk: int, cost: PrefillCost | None = None) -> None:
        self.max_bytes, self.chunk = max_bytes, chunk
        self.cost = cost or PrefillCost()
        self.entries: dict[bytes, Entry] = {}     # by the key of its last block
        self.index: dict[bytes, bytes] = {}       # any block key -> the entry holding it
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def put(self, tokens: Sequence[int], blob: bytes, pin: bool = False) -> bool:
        """Keep this state (tokens must be whole blocks), pinned if asked; False when it cannot
        fit at all."""
        keys = block_chain(tokens, self.chunk)
        if not keys or len(blob) > self.max_bytes:
            return False
        entry = self.entries.get(keys[-1])
        if entry is None:
            while self.bytes + len(blob) > self.max_bytes:
                self._evict_least_valuable()
            entry = Entry(keys, blob, self.cost.cost_ms(len(keys) * self.chunk))
            self.entries[keys[-1]] = entry
            self.bytes += len(blob)
            for k in keys:
                self.index[k] = keys[-1]
        entry.last_used = time.monotonic()
        if pin:
            self._pin(entry)
        return True

    @property
    def pinned_bytes(self) -> int:
        return sum(len(e.blob) for e in self.entries.values() if e.pinned)

    def _pin(self, entry: Entry) -> None:
        limit = PIN_SHARE * self.max_bytes
        if len(entry.blob) > limit:
            log.warning("prompt cache: a %d-byte state is over the RAM tier's pin share (%d bytes); "
                        "kept unpinned", len(entry.blob), limit)
            return
        entry.pinned = True
        while self.pinned_bytes > limit:
            oldest = min((e for e in self.entries.values() if e.pinned and e is not entry),
                         key=lambda e: e.last_used)
            oldest.pinned = False

    def holds(self, tokens: Sequence[int]) -> bool:
        keys = block_chain(tokens, self.chunk)
        return bool(keys) and keys[-1] in self.entries

    def lookup(self, prompt: Sequence[int]) -> tuple[int, Entry | None]:
        """The longest whole-block prefix of `prompt` held here, in tokens, and its entry."""
        for n, key in reversed(list(enumerate(block_chain(prompt, self.chunk), start=1))):
            owner = self.index.get(key)
            if owner is not None:
                entry = self.entries[owner]
                entry.last_used = time.monotonic()
                return n * self.chunk, entry
        return 0, None

    def record_hit(self, n_tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += n_tokens

    def _evict_least_valuable(self) -> None:
        now = time.monotonic()
        unpinned = [k for k, e in self.entries.items() if not e.pinned]
        if unpinned:
            last = min(unpinned, key=lambda k: self.entries[k].value(now))
        else:  # only pins left (a state larger than the free room): the least recently used
            last = min(self.entries, key=lambda k: self.entries[k].last_used)
        entry = self.entries.pop(last)
        self.bytes -= len(entry.blob)
        for k in entry.keys:
            if self.index.get(k) == last:
                # another entry may hold the same prefix: point the block at it
                other = next((e for e in self.entries.values() if k in e.keys), None)
                if other is None:
                    del self.index[k]
                else:
                    self.index[k] = other.keys[-1]

    def stats(self) -> dict[str, int]:
        return {"ram_bytes": self.bytes, "ram_entries": len(self.entries), "ram_hits": self.hits,
                "ram_hit_tokens": self.hit_tokens, "ram_pinned_bytes": self.pinned_bytes}


