"""Prompt cache tiers beyond the slots: a byte-bounded RAM tier of saved sequence states.

The slot tier (in the scheduler) keeps a finished prompt's KV in its slot. When that slot is
needed for other work, its kept blocks are saved with the runner's `save` into this tier,
keyed by a hash chain over grid blocks (vLLM's scheme: each block's key hashes its parent's
key and its tokens), so any request sharing a whole-block prefix with a saved state finds it
and restores instead of recomputing. Every block of an entry is indexed, so a request that
shares only part of an entry's prefix still hits (the restore is then truncated).

Eviction is least-recently-used by bytes for now; eviction by value (recompute cost against
bytes) and the disk tier come next.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def block_chain(tokens: Sequence[int], chunk: int) -> list[bytes]:
    """One key per whole block: key_k = H(key_{k-1} || tokens of block k)."""
    keys, parent = [], b""
    arr = np.asarray(tokens[: len(tokens) // chunk * chunk], dtype=np.int64)
    for start in range(0, len(arr), chunk):
        parent = hashlib.blake2b(parent + arr[start:start + chunk].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class Entry:
    keys: list[bytes]            # the block chain of its tokens
    blob: bytes                  # the runner's saved state for exactly those blocks
    last_used: float = field(default_factory=time.monotonic)

    @property
    def n_blocks(self) -> int:
        return len(self.keys)


class RamTier:
    def __init__(self, max_bytes: int, chunk: int) -> None:
        self.max_bytes, self.chunk = max_bytes, chunk
        self.entries: dict[bytes, Entry] = {}     # by the key of its last block
        self.index: dict[bytes, bytes] = {}       # any block key -> the entry holding it
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def put(self, tokens: Sequence[int], blob: bytes) -> bool:
        """Keep this state (tokens must be whole blocks); False when it cannot fit at all."""
        keys = block_chain(tokens, self.chunk)
        if not keys or len(blob) > self.max_bytes:
            return False
        if keys[-1] in self.entries:
            self.entries[keys[-1]].last_used = time.monotonic()
            return True
        while self.bytes + len(blob) > self.max_bytes:
            self._evict_lru()
        entry = Entry(keys, blob)
        self.entries[keys[-1]] = entry
        self.bytes += len(blob)
        for k in keys:
            self.index[k] = keys[-1]
        return True

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

    def _evict_lru(self) -> None:
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
                "ram_hit_tokens": self.hit_tokens}
