"""Prompt cache tiers beyond the slots: a byte-bounded RAM tier of saved sequence states.

The slot tier (in the scheduler) keeps a finished prompt's KV in its slot. When that slot is
needed for other work, its kept blocks are saved with the runner's `save` into this tier,
keyed by a hash chain over grid blocks (vLLM's scheme: each block's key hashes its parent's
key and its tokens), so any request sharing a whole-block prefix with a saved state finds it
and restores instead of recomputing. Every block of an entry is indexed, so a request that
shares only part of an entry's prefix still hits (the restore is then truncated).

Eviction, in both tiers, is by value: an entry is worth the time it would take to recompute
its tokens at their depths (from the engine's own measured prefill rates, `PrefillCost`) per
byte it holds, halved for every `HALF_LIFE_S` since it was last used; the least valuable goes
first. A long conversation is dear to recompute (attention grows with depth), so forty short
ones do not push it out.

A request may pin its prompt (`cache_pin`: a system prompt with tool schemas that every turn of
an agent starts with): a pinned entry is never evicted by value. Pins may hold at most
`PIN_SHARE` of a tier; past that, the least recently used pin becomes an ordinary entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger("appliance.prefix_cache")


def block_chain(tokens: Sequence[int], chunk: int) -> list[bytes]:
    """One key per whole block: key_k = H(key_{k-1} || tokens of block k)."""
    keys, parent = [], b""
    arr = np.asarray(tokens[: len(tokens) // chunk * chunk], dtype=np.int64)
    for start in range(0, len(arr), chunk):
        parent = hashlib.blake2b(parent + arr[start:start + chunk].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


HALF_LIFE_S = 600.0
PIN_SHARE = 0.5    # most of a tier's bytes that pinned entries may hold
BUCKET = 1024  # depth resolution of the prefill cost model, in tokens


class PrefillCost:
    """Milliseconds per prompt token by depth, learned from the engine's own prefill chunks
    (an exponential average per 1,024-token bucket). Buckets never measured are extrapolated
    from the deepest measured one, assuming per-token cost grows linearly with depth."""

    def __init__(self) -> None:
        self.ms_per_token: dict[int, float] = {}

    def observe(self, start_pos: int, n_tokens: int, ms: float) -> None:
        if n_tokens <= 0 or ms <= 0:
            return
        b = (start_pos + n_tokens // 2) // BUCKET
        old = self.ms_per_token.get(b)
        rate = ms / n_tokens
        self.ms_per_token[b] = rate if old is None else 0.8 * old + 0.2 * rate

    def rate(self, bucket: int) -> float:
        if bucket in self.ms_per_token:
            return self.ms_per_token[bucket]
        if not self.ms_per_token:
            return 1.0 + bucket * 0.5  # nothing measured yet: the shape alone
        known = max(b for b in self.ms_per_token if b <= bucket) if any(
            b <= bucket for b in self.ms_per_token) else min(self.ms_per_token)
        base = self.ms_per_token[known]
        return base * (1.0 + bucket) / (1.0 + known)

    def cost_ms(self, n_tokens: int) -> float:
        full, rest = divmod(n_tokens, BUCKET)
        return sum(BUCKET * self.rate(b) for b in range(full)) + rest * self.rate(full)


def value(cost_ms: float, size: int, idle_s: float) -> float:
    """What keeping an entry is worth: recompute milliseconds per byte, halved per HALF_LIFE_S idle."""
    return cost_ms / max(1, size) * 0.5 ** (max(0.0, idle_s) / HALF_LIFE_S)


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


MAGIC = b"APPLIANCE-KV1\n"


class DiskTier:
    """Saved states as files that survive restarts: `<key>.kv` = magic, a JSON header line
    (fingerprint, block keys, blob length and sha256), the blob. Written to a temporary name
    and renamed, so a crash never leaves a file that loads wrong; at start, files of another
    fingerprint (model, context, KV type, engine version) or that fail their checks are
    deleted. A pinned state has an empty `<key>.pin` beside it. Eviction is by value, with the
    file's modification time (touched on every read) as its last use. Any OS error (full disk,
    read-only directory) turns the tier off with a warning; it never fails a request."""

    def __init__(self, root: Path, max_bytes: int, chunk: int, fingerprint: str,
                 cost: PrefillCost | None = None) -> None:
        self.root, self.max_bytes, self.chunk, self.fingerprint = root, max_bytes, chunk, fingerprint
        self.cost = cost or PrefillCost()   # the scheduler hands in the one it measures
        self.files: dict[bytes, tuple[Path, list[bytes], int]] = {}   # last key -> (path, keys, size)
        self.pinned: set[bytes] = set()
        self.index: dict[bytes, bytes] = {}
        self.enabled = True
        self.hits = 0
        self.hit_tokens = 0
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {root}: {e}")

    @property
    def bytes(self) -> int:
        return sum(size for _, _, size in self.files.values())

    def _disable(self, why: str) -> None:
        log.warning("prompt cache disk tier off: %s", why)
        self.enabled = False

    def _scan(self) -> None:
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write that never finished
        for path in sorted(self.root.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            header = self._header(path)
            if header is None or header.get("fingerprint") != self.fingerprint:
                log.info("prompt cache: deleting %s (%s)", path.name,
                         "stale fingerprint" if header else "unreadable or incomplete")
                path.unlink(missing_ok=True)
                continue
            keys = [bytes.fromhex(k) for k in header["keys"]]
            self._add(path, keys, path.stat().st_size)
            if path.with_suffix(".pin").exists():
                self.pinned.add(keys[-1])
        for pin in self.root.glob("*.pin"):
            if not pin.with_suffix(".kv").exists():
                pin.unlink(missing_ok=True)

    def _header(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                line = f.readline()
                header = json.loads(line)
                f.seek(0, 2)
                if f.tell() != len(MAGIC) + len(line) + header["blob_len"]:
                    return None  # truncated
                return header
        except (OSError, ValueError, KeyError):
            return None

    def _add(self, path: Path, keys: list[bytes], size: int) -> None:
        self.files[keys[-1]] = (path, keys, size)
        for k in keys:
            self.index[k] = keys[-1]

    def holds(self, tokens: Sequence[int]) -> bool:
        keys = block_chain(tokens, self.chunk)
        return self.enabled and bool(keys) and keys[-1] in self.files

    def put(self, tokens: Sequence[int], blob: bytes, pin: bool = False) -> None:
        keys = block_chain(tokens, self.chunk)
        if not self.enabled or not keys:
            return
        if keys[-1] in self.files:
            if pin:
                self._pin(keys[-1])
            return
        header = json.dumps({"fingerprint": self.fingerprint, "keys": [k.hex() for k in keys],
                             "blob_len": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}).encode()
        size = len(MAGIC) + len(header) + 1 + len(blob)
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes and self.files:
            self._evict_least_valuable()
        path = self.root / f"{keys[-1].hex()}.kv"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + header + b"\n" + blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._disable(f"writing {path}: {e}")
            return
        self._add(path, keys, path.stat().st_size)
        if pin:
            self._pin(keys[-1])

    @property
    def pinned_bytes(self) -> int:
        return sum(self.files[k][2] for k in self.pinned)

    def _pin(self, owner: bytes) -> None:
        path, _, size = self.files[owner]
        limit = PIN_SHARE * self.max_bytes
        if size > limit:
            log.warning("prompt cache: %s is over the disk tier's pin share; kept unpinned", path.name)
            return
        try:
            path.with_suffix(".pin").touch()
        except OSError as e:
            self._disable(f"pinning {path}: {e}")
            return
        self.pinned.add(owner)
        while self.pinned_bytes > limit:
            self._unpin(min((k for k in self.pinned if k != owner), key=lambda k: _mtime(self.files[k][0])))

    def _unpin(self, owner: bytes) -> None:
        self.pinned.discard(owner)
        self.files[owner][0].with_suffix(".pin").unlink(missing_ok=True)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, bytes | None]:
        """The longest whole-block prefix held on disk, and its blob (checked), or (0, None)."""
        if not self.enabled:
            return 0, None
        for n, key in reversed(list(enumerate(block_chain(prompt, self.chunk), start=1))):
            owner = self.index.get(key)
            if owner is None:
                continue
            blob = self._read(owner)
            if blob is not None:
                return n * self.chunk, blob
        return 0, None

    def _read(self, owner: bytes) -> bytes | None:
        path, keys, _ = self.files[owner]
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("bad magic")
                header = json.loads(f.readline())
                blob = f.read()
            if len(blob) != header["blob_len"] or hashlib.sha256(blob).hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch")
            os.utime(path)  # recency for eviction
            return blob
        except (OSError, ValueError, KeyError) as e:
            log.warning("prompt cache: ignoring %s (%s)", path.name, e)
            self._drop(owner)
            return None

    def _drop(self, owner: bytes) -> None:
        if owner in self.pinned:
            self._unpin(owner)
        path, keys, _ = self.files.pop(owner)
        for k in keys:
            if self.index.get(k) == owner:
                del self.index[k]
        path.unlink(missing_ok=True)

    def _evict_least_valuable(self) -> None:
        now = time.time()

        def worth(k: bytes) -> float:
            _, keys, size = self.files[k]
            return value(self.cost.cost_ms(len(keys) * self.chunk), size, now - _mtime(self.files[k][0]))
        unpinned = [k for k in self.files if k not in self.pinned]
        if unpinned:
            self._drop(min(unpinned, key=worth))
        else:
            self._drop(min(self.files, key=lambda k: _mtime(self.files[k][0])))

    def record_hit(self, n_tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += n_tokens

    def stats(self) -> dict[str, int]:
        return {"disk_bytes": self.bytes if self.enabled else 0, "disk_entries": len(self.files),
                "disk_hits": self.hits, "disk_hit_tokens": self.hit_tokens, "disk_enabled": int(self.enabled),
                "disk_pinned_bytes": self.pinned_bytes if self.enabled else 0}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
