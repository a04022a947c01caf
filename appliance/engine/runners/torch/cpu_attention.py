"""The torch runner's decode attention on a CPU: `csrc/attend.cpp`, built once per machine.

Short spans (decode steps and speculative verifies, up to model.DECODE_ROWS rows) attend through
it; prompt chunks keep the torch ops path (matmuls over many rows at once). Each query row
attends over exactly its own keys, in fixed 256-key blocks combined in order, so a row's
result depends on its position and the KV alone, never on the rows beside it or the thread
count: the runner's exactness property by construction. Measured per layer against the ops
path it replaces (SmolLM2-135M's shape: 9 query heads on 3 KV heads of 64, bfloat16 KV, one
row, 2 threads): 15-19 against 70-118 µs at 511 keys, 188-225 against 400-700 µs at 8,000.

The extension is compiled with torch's `cpp_extension` (ninja and a C++ compiler) for this
CPU (`-march=native`), into $XDG_CACHE_HOME/appliance/torch_ext under a name that carries
the source's hash, torch's version and the CPU's flags, so an edit, another torch or another
CPU builds anew and a build is otherwise loaded from disk (about 30 s the first time on 2
cores, then well under a second). `load()` says why when it cannot build; the runner then
serves on the ops path and reports it (`--torch-attention auto`), or refuses to start
(`--torch-attention cpp`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("appliance.torch")

SOURCE = Path(__file__).parent / "csrc" / "attend.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
MAX_HEAD_DIM, MAX_GROUP = 256, 16

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]

_lock = threading.Lock()
_loaded: dict[str, tuple[Attend | None, str]] = {}


def cache_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "appliance" / "torch_ext"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_name() -> str:
    """The extension's name: what its machine code depends on, hashed."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return f"appliance_attend_{h.hexdigest()[:16]}"


def load() -> tuple[Attend | None, str]:
    """(the kernel, "") or (None, why not). Built or loaded once per process."""
    name = build_name()
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def _build(name: str) -> tuple[Attend | None, str]:
    try:
        from torch.utils.cpp_extension import load as load_extension

        where = cache_dir() / name
        where.mkdir(parents=True, exist_ok=True)
        fresh = not any(where.glob("*.so"))
        if fresh:
            log.info("building the CPU decode attention kernel (once per machine, about 30 s)")
        mod = load_extension(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                             build_directory=str(where), verbose=False)
        return mod.attend, ""
    except Exception as e:  # noqa: BLE001 - no compiler or ninja, a failed build: the ops path serves
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("the CPU decode attention kernel is not available (%s); attention runs on torch ops", reason)
        return None, reason


def unsupported(n_head: int, n_head_kv: int, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve this model's attention (None: it can)."""
    if kv_dtype not in (torch.bfloat16, torch.float32):
        return f"KV dtype {kv_dtype} (the kernel reads bfloat16 or float32)"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (the kernel takes multiples of 16 up to {MAX_HEAD_DIM})"
    if n_head % n_head_kv or n_head // n_head_kv > MAX_GROUP:
        return f"{n_head} query heads on {n_head_kv} KV heads (at most {MAX_GROUP} a KV head)"
    return None
