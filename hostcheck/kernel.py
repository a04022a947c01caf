"""Kernel release, the full kernel command line, and the distribution."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from .facts import Fs, Runner, Unavailable, key_values, run_command


@dataclass(frozen=True)
class KernelInfo:
    release: str | Unavailable          # e.g. "6.17.0-8-generic"
    cmdline: str | Unavailable          # the full /proc/cmdline, verbatim
    distribution: str | Unavailable     # PRETTY_NAME from os-release

    @property
    def params(self) -> dict[str, str]:
        return cmdline_params(self.cmdline) if isinstance(self.cmdline, str) else {}


def cmdline_params(cmdline: str) -> dict[str, str]:
    """Kernel parameters as {name: value}; a bare flag maps to "". The last occurrence wins.

    Everything after a lone `--` is passed to init, not to the kernel, and is left out.
    """
    try:
        words = shlex.split(cmdline)
    except ValueError:  # an unbalanced quote: fall back to plain whitespace
        words = cmdline.split()
    out: dict[str, str] = {}
    for word in words:
        if word == "--":
            break
        name, _, value = word.partition("=")
        out[name] = value
    return out


def probe_kernel(root: str | Path = "/", run: Runner = run_command) -> KernelInfo:
    fs = Fs(root)
    release = fs.read("/proc/sys/kernel/osrelease")
    cmdline = fs.read("/proc/cmdline")
    return KernelInfo(release=release, cmdline=cmdline, distribution=_distribution(fs))


def _distribution(fs: Fs) -> str | Unavailable:
    for p in ("/etc/os-release", "/usr/lib/os-release"):
        text = fs.read(p)
        if isinstance(text, str):
            kv = key_values(text, "=")
            name = kv.get("PRETTY_NAME") or kv.get("NAME")
            if name:
                return name.strip('"\'')
            return Unavailable(f"{p} has no PRETTY_NAME or NAME")
    return Unavailable("no /etc/os-release or /usr/lib/os-release")
