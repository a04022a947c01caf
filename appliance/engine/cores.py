"""Sharing the cores: between the engines of one server, and with the rest of the machine.

llama.cpp's and torch's compute threads spin at their barriers (compute_settings: libgomp's
default wait, the fastest alone). Two spinning thread pools on the same cores each burn the
slices the other's threads need, and both collapse by one or two orders of magnitude. So:

- `Turns`: the engines of a server that may run several models at once take turns at the
  cores, one forward (one scheduler step, one embedding batch) at a time, by an exclusive
  `flock` on one file the pool names. The kernel wakes a waiter as the holder lets go, so two
  busy engines alternate step by step (measured here: 280 and 281 turns of 5 ms in 3 s), and it
  frees the lock of an engine that dies, so a crash never stalls the others. Each engine's
  steps run at full speed, in turn: two streams on two models get about half each, as one
  model decoding both would.
- Idle work (settling replies, writing prompt states) runs only when it would run beside
  nothing: no other engine of the server has a turn, and the rest of the machine used less
  than NEIGHBOUR_CORES over the last idle tick (`Neighbours`, from /proc/stat against this
  process's own time). It is work the next request would otherwise do; doing it beside a build
  or a bench's raw reference would cost them far more than it saves. On a machine that is never
  that quiet, replies are not settled: the next turn recomputes them, as it would have anyway.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Iterator

NEIGHBOUR_CORES = 0.5    # others using more than half a core: the machine is not idle


class Turns:
    """One forward at a time across the engines that share `path` (None: alone, no lock)."""

    def __init__(self, path: str | None) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else None

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the cores for one forward, waiting (asleep) for another engine's to end."""
        if self.fd is None:
            yield
            return
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def idle_turn(self) -> Iterator[bool]:
        """A turn for idle work if no other engine holds one now (True), else nothing (False)."""
        if self.fd is None:
            yield True
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _busy_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of the whole machine since boot, from /proc/stat's cpu line."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)    # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _own_ticks() -> int:
    """Clock ticks this process has run (all its threads), user and system."""
    t = os.times()
    return round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


class Neighbours:
    """Whether the rest of the machine computed since the last look: `busy()` compares the
    machine's busy time with this process's own over the interval (at least MIN_WINDOW_S)."""

    MIN_WINDOW_S = 0.05
    MAX_WINDOW_S = 0.5   # a longer window would dilute a neighbour that just started: look again

    def __init__(self) -> None:
        self._last: tuple[float, tuple[int, int] | None, int] = (time.monotonic(), _busy_ticks(), _own_ticks())
        self._verdict = False

    def busy(self) -> bool:
        now = time.monotonic()
        t0, machine0, own0 = self._last
        if now - t0 < self.MIN_WINDOW_S:
            return self._verdict            # too short a window to say: the last answer
        machine, own = _busy_ticks(), _own_ticks()
        self._last = (now, machine, own)
        if now - t0 > self.MAX_WINDOW_S:
            self._verdict = True            # not looked at for a while: say busy, look again soon
            return True
        if machine is None or machine0 is None:
            self._verdict = False           # no /proc/stat: nothing to yield to that we can see
            return False
        hz = os.sysconf("SC_CLK_TCK")
        others = (machine[0] - machine0[0]) - (own - own0)
        self._verdict = others / hz > NEIGHBOUR_CORES * (now - t0)
        return self._verdict
