"""The disk tier of the prompt cache: saved states as files that survive restarts.

One file per state (kvfile.py: the format and its checks). Eviction is by value (`cost.value`),
with a file's modification time, touched on every read, as its last use; a pinned state has an
empty `<key>.pin` beside it. At start, files of another fingerprint (model, context, KV type,
engine version) or that fail their checks are deleted.

Writing a file is slow next to a decode step (a 165 MB state, checksum then write and fsync,
took most of a second on a loaded 2-core host) and a spill happens on the step path, so with a
write-behind queue (`queue_bytes` > 0, as the engine starts the tier) `put` only queues the
blob and returns; one writer thread checksums and writes it. The queue is bounded in bytes: a
state that does not fit is not written, and counted as `skipped`; the step never waits for the
disk. An empty queue takes a state of any size, so a large one is never starved. A queued
state is served from memory until its file is written, so a hit right after a spill restores
the very same bytes. One lock guards the index, the queue and eviction; no state file is
written, read or deleted under it. At shutdown `drain` waits, bounded, for the queue; a write
cut short leaves only a temporary file, which the next start deletes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..grid import common_prefix
from . import kvfile
from .cost import PrefillCost, value
from .ram import INDEX_BLOCK, PIN_SHARE, block_chain, state_key

log = logging.getLogger("appliance.prefix_cache")

WRITE_QUEUE_BYTES = 1 << 30   # states waiting for the writer thread, at most (the engine's setting)
MAX_WRITE_ERRORS = 3          # failed writes in a row that turn the tier off (a full or broken disk)
CLOSE_TIMEOUT_S = 5.0         # how long `close` waits for a write in progress
WRITER_NICE = 19              # the writer thread yields the CPU to the decode threads


@dataclass
class Queued:
    """A state handed to the writer and not yet in its file: lookups serve `blob` from memory."""

    tokens: tuple[int, ...]  # what the state holds
    keys: list[bytes]        # the block chain of its tokens
    blob: bytes              # the runner's saved state, shared with the RAM tier (not a copy)
    exact: int               # leading positions that are exact to reuse
    pin: bool = False


@dataclass(frozen=True)
class Held:
    """A state in its file."""

    path: Path
    tokens: tuple[int, ...]
    keys: list[bytes]
    size: int                # of the file
    exact: int


class DiskTier:
    """Saved states as files that survive restarts, behind a write-behind queue. An OS error
    at start (a missing or read-only directory) turns the tier off with a warning; a failed
    write loses that state only (logged, counted in `write_errors`), and `MAX_WRITE_ERRORS` in
    a row turn the tier off. It never fails a request. With `queue_bytes` 0 there is no writer
    thread: `put` writes in the caller's thread."""

    def __init__(self, root: Path, max_bytes: int, fingerprint: str, block: int = INDEX_BLOCK,
                 cost: PrefillCost | None = None, queue_bytes: int = 0) -> None:
        self.root, self.max_bytes, self.block, self.fingerprint = root, max_bytes, block, fingerprint
        self.cost = cost or PrefillCost()   # the scheduler hands in the one it measures
        self.files: dict[bytes, Held] = {}       # state key -> its file
        self.queued: dict[bytes, Queued] = {}    # state key -> state, oldest first
        self.pinned: set[bytes] = set()
        self.index: dict[bytes, bytes] = {}   # any block key -> the state key of a file or queued state
        self.queue_bytes, self.queued_bytes = queue_bytes, 0
        self.enabled = True
        self.hits = self.hit_tokens = 0
        self.skipped = self.write_errors = self._errors_in_row = 0
        self._lock = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {root}: {e}")

    @property
    def bytes(self) -> int:
        return sum(h.size for h in self.files.values())

    def _disable(self, why: str) -> None:
        log.warning("prompt cache disk tier off: %s", why)
        with self._lock:
            self.enabled = False
            for owner in list(self.queued):
                self._discard(owner)
            self._lock.notify_all()

    def _scan(self) -> None:
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write that never finished
        for path in sorted(self.root.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            header = kvfile.read_header(path)
            if header is None or header.get("fingerprint") != self.fingerprint:
                log.info("prompt cache: deleting %s (%s)", path.name,
                         "stale fingerprint" if header else "unreadable or incomplete")
                path.unlink(missing_ok=True)
                continue
            tokens = tuple(int(t) for t in header["tokens"])
            exact = int(header.get("exact", len(tokens)))
            keys = block_chain(tokens, self.block)
            owner = state_key(tokens, keys, self.block)
            if not keys or path.stem != owner.hex():
                path.unlink(missing_ok=True)  # indexed with another block size
                continue
            self._add(owner, Held(path, tokens, keys, path.stat().st_size, exact))
            if path.with_suffix(".pin").exists():
                self.pinned.add(owner)
        for pin in self.root.glob("*.pin"):
            if not pin.with_suffix(".kv").exists():
                pin.unlink(missing_ok=True)

    def _add(self, owner: bytes, held: Held) -> None:
        self.files[owner] = held
        for k in held.keys:
            self.index[k] = owner

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether this exact state is on disk or queued for it."""
        keys = block_chain(tokens, self.block)
        if not keys:
            return False
        owner = state_key(tokens, keys, self.block)
        with self._lock:
            return self.enabled and (owner in self.files or owner in self.queued)

    # -- writing -----------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], blob: bytes, pin: bool = False, wait_s: float = 0.0,
            exact: int | None = None) -> bool:
        """Save this state (of at least one whole block), pinned if asked. With a writer thread
        it is queued and `put` returns at once, or after waiting at most `wait_s` for room.
        False when it is not kept: the tier is off, the state is larger than the tier, or the
        queue stayed full (counted in `skipped`)."""
        keys = block_chain(tokens, self.block)
        if not keys:
            return False
        owner = state_key(tokens, keys, self.block)
        with self._lock:
            if not self.enabled or self._closed:
                return False
            if owner in self.files or owner in self.queued:
                if pin:
                    self._pin(owner)
                return True
            if kvfile.file_size(self.fingerprint, tokens, len(blob), exact) > self.max_bytes:
                return False
            if self.queue_bytes and not self._lock.wait_for(lambda: self._room(len(blob)), wait_s):
                self.skipped += 1
                return False
            if not self.enabled:
                return False
            self._enqueue(owner, Queued(tuple(tokens), keys, blob, len(tokens) if exact is None else exact, pin))
        if not self.queue_bytes:
            self._write_one(owner)
        return True

    def _room(self, size: int) -> bool:
        """Whether a state of `size` bytes may join the queue now (or the tier went off)."""
        return not self.enabled or not self.queued or self.queued_bytes + size <= self.queue_bytes

    def _enqueue(self, owner: bytes, item: Queued) -> None:
        self.queued[owner] = item
        self.queued_bytes += len(item.blob)
        for k in item.keys:
            self.index[k] = owner
        if self.queue_bytes and self._writer is None:
            self._writer = threading.Thread(target=self._run, name="prompt-cache-writer", daemon=True)
            self._writer.start()
        self._lock.notify_all()

    def _unqueue(self, owner: bytes) -> Queued:
        item = self.queued.pop(owner)
        self.queued_bytes -= len(item.blob)
        return item

    def _discard(self, owner: bytes) -> None:
        """Forget a queued state that will not be written (under the lock)."""
        self._unindex(owner, self._unqueue(owner).keys)

    def _run(self) -> None:
        """The writer thread: the oldest queued state, one at a time, until closed. Its
        checksum and copy into the page cache are CPU work; at the default priority they took
        the cores llama.cpp's threads decode on (a stream's gaps grew to ~150 ms while a 165 MB
        state was written on 2 cores), so it runs niced: on Linux a thread id is a process id
        to setpriority, and only this thread changes."""
        with suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self.queued or self._closed)
                if self._closed:
                    return
                owner = next(iter(self.queued))
            self._write_one(owner)

    def _write_one(self, owner: bytes) -> None:
        """Write one queued state to its file, then move it from the queue to the files. A
        failure loses this state only."""
        with self._lock:
            item = self.queued.get(owner)
        if item is None:
            return  # the tier turned off meanwhile
        path = self.root / f"{owner.hex()}.kv"
        try:
            header = kvfile.header_line(self.fingerprint, item.tokens, item.blob, item.exact)  # the slow checksum, unlocked
            size = len(kvfile.MAGIC) + len(header) + 1 + len(item.blob)
            with self._lock:
                doomed = self._make_room(size)
            for p in doomed:
                p.unlink(missing_ok=True)
            self._write_file(path, header, item.blob)
        except Exception as e:  # an OS error, or a bug: either must not stop the writer
            self._failed(owner, path, e)
            return
        with self._lock:
            if self.queued.get(owner) is item:
                self._unqueue(owner)
                self._add(owner, Held(path, item.tokens, item.keys, size, item.exact))
                self._errors_in_row = 0
                if item.pin:
                    self._pin(owner)
            self._lock.notify_all()

    def _write_file(self, path: Path, header: bytes, blob: bytes) -> None:
        kvfile.write(path, header, blob)  # on its own, so that tests can hold a write

    def _failed(self, owner: bytes, path: Path, e: Exception) -> None:
        if isinstance(e, OSError):
            log.warning("prompt cache: could not write %s: %s", path.name, e)
        else:
            log.exception("prompt cache: writing %s failed", path.name)
        with self._lock:
            if owner in self.queued:
                self._discard(owner)
            self.write_errors += 1
            self._errors_in_row += 1
            if self._errors_in_row >= MAX_WRITE_ERRORS:
                self._disable(f"{MAX_WRITE_ERRORS} writes in a row failed, the last: {e}")
            self._lock.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until every queued state is written; False if some is not."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.queued, timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the writer after the write in progress; what is still queued is not written
        (`drain` first to keep it)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._writer is not None:
            self._writer.join(timeout_s)

    # -- pinning -----------------------------------------------------------------------------
    @property
    def pinned_bytes(self) -> int:
        return sum(self.files[k].size for k in self.pinned)

    def _pin(self, owner: bytes) -> None:
        """Pin a written state now, a queued one once it is written (under the lock)."""
        if owner in self.queued:
            self.queued[owner].pin = True
            return
        path, size = self.files[owner].path, self.files[owner].size
        limit = PIN_SHARE * self.max_bytes
        if size > limit:
            log.warning("prompt cache: %s is over the disk tier's pin share; kept unpinned", path.name)
            return
        try:
            path.with_suffix(".pin").touch()
        except OSError as e:
            log.warning("prompt cache: could not pin %s: %s", path.name, e)
            return
        self.pinned.add(owner)
        while self.pinned_bytes > limit:
            self._unpin(min((k for k in self.pinned if k != owner), key=lambda k: _mtime(self.files[k].path)))

    def _unpin(self, owner: bytes) -> None:
        self.pinned.discard(owner)
        self.files[owner].path.with_suffix(".pin").unlink(missing_ok=True)

    # -- reading -----------------------------------------------------------------------------
    def lookup(self, prompt: Sequence[int], wanted: Callable[[int, int], bool] | None = None
               ) -> tuple[int, tuple[int, ...], bytes | None, int]:
        """The state on disk or queued for it that shares the longest prefix with `prompt`
        (found by whole blocks, then compared token by token): how many tokens it shares, its
        tokens, its blob (a file's checked) and how many leading positions are exact; or
        (0, (), None, 0). `wanted(shared, exact)`: whether such a state is worth its blob; a
        file is read only then (not the one a slot already holds, saved while it idled)."""
        if not self.enabled:
            return 0, (), None, 0
        for key in reversed(block_chain(prompt, self.block)):
            with self._lock:
                owner = self.index.get(key)
                item = self.queued.get(owner) if owner is not None else None
                held = self.files.get(owner) if item is None and owner is not None else None
            state = item or held
            if state is None or (wanted is not None and not wanted(common_prefix(state.tokens, prompt), state.exact)):
                continue
            blob = item.blob if item is not None else self._read(owner, held.path)
            if blob is not None:
                return common_prefix(state.tokens, prompt), state.tokens, blob, state.exact
        return 0, (), None, 0

    def _read(self, owner: bytes, path: Path) -> bytes | None:
        """A file's blob, checked; None (and the file dropped) when it fails its checks."""
        try:
            blob = kvfile.read_blob(path)
        except (OSError, ValueError, KeyError) as e:
            with self._lock:
                if owner not in self.files or self.files[owner].path != path:
                    return None  # evicted by the writer meanwhile: not a fault of the file
                log.warning("prompt cache: ignoring %s (%s)", path.name, e)
                self._drop(owner)
            path.unlink(missing_ok=True)
            return None
        with suppress(OSError):
            os.utime(path)  # recency for eviction
        return blob

    # -- forgetting --------------------------------------------------------------------------
    def _drop(self, owner: bytes) -> Path:
        """Forget a file (under the lock); the caller deletes the returned path."""
        if owner in self.pinned:
            self._unpin(owner)
        held = self.files.pop(owner)
        self._unindex(owner, held.keys)
        return held.path

    def _unindex(self, owner: bytes, keys: list[bytes]) -> None:
        """Point the blocks `owner` held at another file or queued state that holds them."""
        for k in keys:
            if self.index.get(k) != owner:
                continue
            other = next((o for o, ks in self._entries() if k in ks), None)
            if other is None:
                del self.index[k]
            else:
                self.index[k] = other

    def _entries(self) -> Iterator[tuple[bytes, list[bytes]]]:
        yield from ((o, h.keys) for o, h in self.files.items())
        yield from ((o, q.keys) for o, q in self.queued.items())

    def _make_room(self, size: int) -> list[Path]:
        """Evict (under the lock) until a file of `size` bytes fits; the paths to delete."""
        doomed = []
        while self.bytes + size > self.max_bytes and self.files:
            doomed.append(self._evict_least_valuable())
        return doomed

    def _evict_least_valuable(self) -> Path:
        now = time.time()

        def worth(k: bytes) -> float:
            held = self.files[k]
            return value(self.cost.cost_ms(len(held.tokens)), held.size, now - _mtime(held.path))
        unpinned = [k for k in self.files if k not in self.pinned]
        if unpinned:
            return self._drop(min(unpinned, key=worth))
        return self._drop(min(self.files, key=lambda k: _mtime(self.files[k].path)))

    def record_hit(self, n_tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += n_tokens

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"disk_bytes": self.bytes if self.enabled else 0, "disk_entries": len(self.files),
                    "disk_hits": self.hits, "disk_hit_tokens": self.hit_tokens, "disk_enabled": int(self.enabled),
                    "disk_pinned_bytes": self.pinned_bytes if self.enabled else 0,
                    "disk_queued_bytes": self.queued_bytes, "disk_skipped": self.skipped,
                    "disk_write_errors": self.write_errors}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
