"""Start-up probe results remembered on disk (`--probe-cache DIR`), so that a restart of the
same model under the same settings on the same machine does not measure again what it just
measured: whether a k-row verify equals k steps, what a forward of m rows costs, and which chunk
cuts compute as the grid does (spec/probe.py, cache/invariance.py). Off by default: every start
measures.

A result is a function of the probe and its inputs and of everything that changes the
arithmetic: the runner's KV fingerprint (model file, context, KV type, the engine's version,
batch shapes, threads, kernels, placement), its settings and placement (less the free memory
and budgets, which change from one start to the next), the native libraries it loaded (a
rebuild with another backend is another file), the CPU (llama.cpp and torch choose kernels by
its flags) and this appliance's version. All of it is hashed into the file's name, and the whole
key is stored beside the result and compared when read: a file that does not match, or does not
parse, is measured again and rewritten. Costs are timings: remembered, they are the first
start's (a busy machine then makes them pessimistic until the file is removed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from .. import __version__
from .runners.base import ModelRunner

log = logging.getLogger("appliance.engine")

T = TypeVar("T")


def _cpu() -> str:
    """The CPU's model name and flags (what kernel choices follow), or "" where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))   # the first core's lines; the others repeat them


def _native(runner: ModelRunner) -> list[tuple[str, int, int]]:
    """Name, size and mtime of each file in the directories of the runner's native libraries."""
    out = []
    for d in sorted({Path(p).parent for p in runner_libraries(runner)}):
        try:
            for f in sorted(d.iterdir()):
                st = f.stat()
                out.append((str(f), st.st_size, int(st.st_mtime)))
        except OSError:
            continue
    return out


def runner_libraries(runner: ModelRunner) -> list[str]:
    """Files of the native code a runner computes with: llama.cpp's shared library for it (the
    torch runner's version, kernels and device are in its settings already)."""
    if runner.info.backend != "llama.cpp":
        return []
    import llama_cpp.llama_cpp as L

    lib = getattr(getattr(L, "_lib", None), "_name", None)
    return [lib] if lib else []


def digest(ids: Sequence[int]) -> str:
    """A probe prompt's tokens, as a memo's key holds them."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


# what a placement report holds that changes from one start to the next, not the arithmetic:
# free memory, the budgets made of it, and the notes that quote them
VOLATILE = frozenset({"free", "budget", "headroom", "notes"})


def stable(report: Any) -> Any:
    """A placement report (`/health`'s placement) without its VOLATILE figures, at any depth."""
    if isinstance(report, dict):
        return {k: stable(v) for k, v in report.items() if k not in VOLATILE}
    if isinstance(report, (list, tuple)):
        return [stable(v) for v in report]
    return report


class ProbeMemo:
    """`memo(name, inputs, measure, kind)`: the remembered result of a probe on this runner, or
    `measure()`'s, then remembered. Without a directory it measures every time."""

    def __init__(self, directory: str | None, runner: ModelRunner) -> None:
        self.dir = Path(directory).expanduser() if directory else None
        self.base: dict[str, Any] = {}
        if self.dir is not None:
            self.base = {"appliance": __version__, "kv": runner.kv_fingerprint(),
                         "settings": runner.info.settings, "placement": stable(runner.info.placement),
                         "native": _native(runner), "cpu": _cpu()}

    def __call__(self, name: str, inputs: Any, measure: Callable[[], T], kind: type[T]) -> T:
        if self.dir is None:
            return measure()
        key = json.loads(json.dumps({**self.base, "probe": name, "inputs": inputs}, sort_keys=True, default=str))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        path = self.dir / f"{name}-{digest}.json"
        found = self._read(path, key, kind)
        if found is not None:
            log.info("%s: remembered from %s", name, path)
            return found
        result = measure()
        self._write(path, key, dataclasses.asdict(result))
        return result

    @staticmethod
    def _read(path: Path, key: dict, kind: type[T]) -> T | None:
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") != key:
                return None
            fields = {f.name: f for f in dataclasses.fields(kind)}
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in stored["result"].items()}
            return kind(**{k: v for k, v in values.items() if k in fields})
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    @staticmethod
    def _write(path: Path, key: dict, result: dict) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "result": result}, sort_keys=True))
            os.replace(tmp, path)            # whole or not at all, whoever reads it meanwhile
        except OSError as e:
            log.warning("probe results not remembered in %s: %s", path.parent, e)
