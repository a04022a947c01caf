"""System memory and transparent huge pages, from /proc/meminfo and /sys/kernel/mm."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .facts import Fs, Runner, Unavailable, key_values, run_command

THP = "/sys/kernel/mm/transparent_hugepage"


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int | Unavailable
    available_bytes: int | Unavailable
    thp_enabled: str | Unavailable      # always, madvise or never (the bracketed choice)
    thp_defrag: str | Unavailable


def probe_memory(root: str | Path = "/", run: Runner = run_command) -> MemoryInfo:
    fs = Fs(root)
    meminfo = fs.read("/proc/meminfo")
    return MemoryInfo(
        total_bytes=_meminfo_bytes(meminfo, "MemTotal"),
        available_bytes=_meminfo_bytes(meminfo, "MemAvailable"),
        thp_enabled=selected_choice(fs.read(f"{THP}/enabled")),
        thp_defrag=selected_choice(fs.read(f"{THP}/defrag")),
    )


def selected_choice(text: str | Unavailable) -> str | Unavailable:
    """`always [madvise] never` -> `madvise`; sysfs marks the active choice with brackets."""
    if isinstance(text, Unavailable):
        return text
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.strip() or Unavailable("empty setting")


def _meminfo_bytes(meminfo: str | Unavailable, key: str) -> int | Unavailable:
    if isinstance(meminfo, Unavailable):
        return meminfo
    raw = key_values(meminfo).get(key)
    if raw is None:
        return Unavailable(f"no {key} in /proc/meminfo")
    number, _, unit = raw.partition(" ")
    try:
        return int(number) * (1024 if unit.strip() == "kB" else 1)
    except ValueError:
        return Unavailable(f"{key} in /proc/meminfo is {raw!r}")
