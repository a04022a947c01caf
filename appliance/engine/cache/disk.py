"""The disk tier of the prompt cache: saved states as files that survive restarts."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from .cost import PrefillCost, value
from .ram import PIN_SHARE, block_chain

log = logging.getLogger("appliance.prefix_cache")

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
