"""The RAM tier of the prompt cache: a byte-bounded store of saved sequence states.

When a slot whose kept positions would be overwritten is taken, they are saved with the
runner's `save` into this tier. A state holds any number of tokens; it is indexed by a hash
chain over its whole `block`-token blocks (vLLM's scheme: each block's key hashes its parent's
key and its tokens), so a request sharing a prefix with a saved state finds it, and the state
keeps its tokens, so the match is then extended to the exact common prefix. Every block of an
entry is indexed, so a request that shares only part of an entry's prefix still hits (the
restore is then truncated). What of a match may be reused (whole grid blocks, or any position)
is the grid's to say, not the tier's.

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

from ..grid import common_prefix
from .cost import PrefillCost, value

log = logging.getLogger("appliance.prefix_cache")

PIN_SHARE = 0.5    # most of a tier's bytes that pinned entries may hold
INDEX_BLOCK = 64   # tokens per indexed block: a shared prefix is found to within this, then exactly


def index_block(chunk: int) -> int:
    """The block a tier indexes by for a prefill grid of `chunk`: never coarser than the grid,
    whose whole blocks are the least a state holds when reuse is at grid lines."""
    return min(INDEX_BLOCK, chunk)


def block_chain(tokens: Sequence[int], block: int) -> list[bytes]:
    """One key per whole block: key_k = H(key_{k-1} || tokens of block k)."""
    keys, parent = [], b""
    arr = np.asarray(tokens[: len(tokens) // block * block], dtype=np.int64)
    for start in range(0, len(arr), block):
        parent = hashlib.blake2b(parent + arr[start:start + block].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


def state_key(tokens: Sequence[int], keys: Sequence[bytes], block: int) -> bytes:
    """The key of a state of exactly these tokens: its last block's key and the tokens after it."""
    tail = np.asarray(tokens[len(keys) * block:], dtype=np.int64)
    return hashlib.blake2b((keys[-1] if keys else b"") + b"|" + tail.tobytes(), digest_size=16).digest()


@dataclass
class Entry:
    tokens: tuple[int, ...]      # what the state holds, position by position
    keys: list[bytes]            # the block chain of its tokens
    blob: bytes                  # the runner's saved state for exactly those tokens
    exact: int = 0               # leading positions that are exact to reuse (all but in fast mode)
    cost_ms: float = 0.0         # what recomputing it would take
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False

    def value(self, now: float) -> float:
        """Recompute milliseconds per byte, halved per HALF_LIFE_S unused."""
        return value(self.cost_ms, len(self.blob), now - self.last_used)


class RamTier:
    def __init__(self, max_bytes: int, block: int = INDEX_BLOCK, cost: PrefillCost | None = None) -> None:
        self.max_bytes, self.block = max_bytes, block
        self.cost = cost or PrefillCost()
        self.entries: dict[bytes, Entry] = {}     # by its state key
        self.index: dict[bytes, bytes] = {}       # any block key -> the entry holding it
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def put(self, tokens: Sequence[int], blob: bytes, pin: bool = False, exact: int | None = None) -> bool:
        """Keep this state (of at least one whole block), pinned if asked; False when it
        cannot fit at all."""
        keys = block_chain(tokens, self.block)
        if not keys or len(blob) > self.max_bytes:
            return False
        owner = state_key(tokens, keys, self.block)
        entry = self.entries.get(owner)
        if entry is None:
            while self.bytes + len(blob) > self.max_bytes:
                self._evict_least_valuable()
            entry = Entry(tuple(tokens), keys, blob, len(tokens) if exact is None else exact,
                          self.cost.cost_ms(len(tokens)))
            self.entries[owner] = entry
            self.bytes += len(blob)
            for k in keys:
                self.index[k] = owner
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
        keys = block_chain(tokens, self.block)
        return bool(keys) and state_key(tokens, keys, self.block) in self.entries

    def lookup(self, prompt: Sequence[int]) -> tuple[int, Entry | None]:
        """The entry sharing the longest prefix with `prompt` (found by whole blocks, then
        compared token by token), and how many tokens it shares."""
        for key in reversed(block_chain(prompt, self.block)):
            owner = self.index.get(key)
            if owner is not None:
                entry = self.entries[owner]
                entry.last_used = time.monotonic()
                return common_prefix(entry.tokens, prompt), entry
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
                other = next((o for o, e in self.entries.items() if k in e.keys), None)
                if other is None:
                    del self.index[k]
                else:
                    self.index[k] = other

    def stats(self) -> dict[str, int]:
        return {"ram_bytes": self.bytes, "ram_entries": len(self.entries), "ram_hits": self.hits,
                "ram_hit_tokens": self.hit_tokens, "ram_pinned_bytes": self.pinned_bytes}


