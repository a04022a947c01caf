"""The pieces every probe shares: `Unavailable`, file reads under a root, and the command runner.

A probe never raises. Each fact it returns is either its value or `Unavailable(reason)`, so a
report can say *why* it cannot tell (no such file, permission denied, tool not installed)
instead of printing a blank. Probes read below a `root` (default `/`) and run tools through an
injected `Runner`, which is how the tests point them at fixture trees and fake `nvidia-smi`.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Unavailable:
    """A fact the host did not expose, with the reason."""

    reason: str

    def __str__(self) -> str:
        return f"unavailable ({self.reason})"


def known(value: object) -> bool:
    return value is not None and not isinstance(value, Unavailable)


def value_or(value: T | Unavailable, default: T | None = None) -> T | None:
    return default if isinstance(value, Unavailable) else value


# A runner takes argv and returns the command's stdout, or Unavailable with the reason.
Runner = Callable[[Sequence[str]], "str | Unavailable"]


def run_command(argv: Sequence[str], timeout_s: float = 10.0) -> str | Unavailable:
    """Run a tool if it is installed; never raises."""
    exe = shutil.which(argv[0])
    if exe is None:
        return Unavailable(f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return Unavailable(f"{argv[0]} failed: {type(e).__name__}")
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()[:1]
        detail = f": {first[0]}" if first else ""
        return Unavailable(f"{argv[0]} exited {proc.returncode}{detail}")
    return proc.stdout


class Fs:
    """Reads files below `root` as if it were `/`; every read returns a value or Unavailable."""

    def __init__(self, root: str | Path = "/"):
        self.root = Path(root)

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def exists(self, p: str) -> bool:
        return self.path(p).exists()

    def read(self, p: str) -> str | Unavailable:
        try:
            return self.path(p).read_text(errors="replace").strip()
        except FileNotFoundError:
            return Unavailable(f"no {p}")
        except PermissionError:
            return Unavailable(f"{p} is not readable by this user")
        except OSError as e:  # sysfs files can refuse reads (EINVAL, ENODATA, EIO)
            return Unavailable(f"reading {p} failed: {e.strerror or type(e).__name__}")

    def read_int(self, p: str, base: int = 10) -> int | Unavailable:
        text = self.read(p)
        if isinstance(text, Unavailable):
            return text
        try:
            return int(text.split()[0], base)
        except (ValueError, IndexError):
            return Unavailable(f"{p} holds {text[:40]!r}, not a number")

    def glob(self, pattern: str) -> list[str]:
        """Absolute-style paths (as seen from the root) matching `pattern`, sorted naturally."""
        try:
            found = list(self.root.glob(pattern.lstrip("/")))
        except OSError:
            return []
        return sorted(("/" + str(f.relative_to(self.root)) for f in found), key=_natural)

    def listdir(self, p: str) -> list[str] | Unavailable:
        try:
            return sorted((e.name for e in self.path(p).iterdir()), key=_natural)
        except FileNotFoundError:
            return Unavailable(f"no {p}")
        except OSError as e:
            return Unavailable(f"listing {p} failed: {e.strerror or type(e).__name__}")


def _natural(s: str) -> list:
    """Sort key so that cpu10 comes after cpu9 and hwmon10 after hwmon2."""
    out: list = []
    for part in re.split(r"(\d+)", s):
        out.append((0, int(part)) if part.isdigit() else (1, part))
    return out


def key_values(text: str, sep: str = ":") -> dict[str, str]:
    """`key<sep>value` lines (as in /proc/cpuinfo or /proc/meminfo) to a dict; first one wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found and key.strip() and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts, Unavailable to {"unavailable": reason}, tuples to lists."""
    if isinstance(obj, Unavailable):
        return {"unavailable": obj.reason}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def cached(run: Runner) -> Runner:
    """A runner that runs each distinct argv once (one snapshot asks rocminfo for two facts)."""
    memo: dict[tuple[str, ...], str | Unavailable] = {}

    def runner(argv: Sequence[str]) -> str | Unavailable:
        key = tuple(argv)
        if key not in memo:
            memo[key] = run(argv)
        return memo[key]

    return runner
