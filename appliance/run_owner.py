"""The process that writes a stored run, and whether it is known to be gone: what lets the
result store (store.py) tell a run killed with kill -9, or by a power cut, from one still being
written. Read from /proc; where /proc does not tell (not Linux), a process has no Owner and its
runs are never judged."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Owner:
    """The process that writes a run. A pid names a process only within one boot of one host and
    one pid namespace (a container has its own); the process's start time tells the one that wrote
    the run from a later process given the same pid. WAL needs every process using the file on one
    kernel, so a live writer always shares this opener's host name and boot."""

    host: str        # socket.gethostname()
    boot: str        # /proc/sys/kernel/random/boot_id
    pidns: str       # the /proc/self/ns/pid link, "pid:[4026531836]"
    pid: int
    start: int       # field 22 of /proc/<pid>/stat: clock ticks after boot

    @classmethod
    def current(cls) -> Owner | None:
        """This process; None where /proc does not tell (not Linux): its runs are never judged."""
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            pidns = os.readlink("/proc/self/ns/pid")
        except OSError:
            return None
        pid = os.getpid()
        start = _start_ticks(pid)
        return None if start is None else cls(socket.gethostname(), boot, pidns, pid, start)

    def gone(self, me: Owner) -> str | None:
        """Why this run's process is known to be gone, as `me` (this process) sees it; None while
        it lives or cannot be seen from here: another host's run, another pid namespace's."""
        if self.host != me.host:
            return None
        if self.boot != me.boot:
            why = "the host restarted since"
        elif self.pidns != me.pidns:
            return None
        elif _start_ticks(self.pid) != self.start:     # gone, or its pid now names another process
            why = "it ended without finishing the run"
        else:
            return None
        return f"process {self.pid} on {self.host}, which wrote this run, is gone: {why}"


def _start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot); None when there is none, or only its
    zombie (killed, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    after_name = stat.rsplit(")", 1)[1].split()     # the name in parentheses may hold anything
    return None if after_name[0] in ("Z", "X") else int(after_name[19])
