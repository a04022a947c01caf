"""The torch runner's CPU kernels: `csrc/cpu_kernels.cpp`, built once per machine.

On a CPU without the Triton kernels, a layer's small operations go through it: RMSNorm, RoPE
and SwiGLU on every row (each replaces several torch ops and their dispatch, and hands the next
matmul its operand in the compute dtype), and the attention of short spans (decode steps and
speculative verifies, up to model.DECODE_ROWS rows); prompt chunks attend through torch ops
(matmuls over many rows at once). Each kernel computes a row on its own in a fixed order, so a
row's result depends on its inputs alone, never on the rows beside it or the thread count: the
runner's exactness properties by construction. Measured per layer against the ops path
(SmolLM2-135M's shape: 9 query heads on 3 KV heads of 64, bfloat16 KV, one row, 2 threads),
the attention takes 15-19 against 70-118 µs at 511 keys, 188-225 against 400-700 µs at 8,000;
the rest of a decode step is 11-12% shorter with the other three. And, on AVX512-BF16 CPUs,
the int4 matmul (`int4_matmul`; `use` packs the model's `qlinear.Int4Linear`s for it): a
decode step 1.40x faster at depth 512 than on torch's int4 kernel.

The extension is compiled with torch's `cpp_extension` (ninja and a C++ compiler) for this
CPU (`-march=native`), into $XDG_CACHE_HOME/appliance/torch_ext under a name that carries
the source's hash, torch's version and the CPU's flags, so an edit, another torch or another
CPU builds anew and a build is otherwise loaded from disk (about 14 s the first time on 2
cores, then well under a second). The runner calls `prefetch()` first thing, so that a first
build (the compiler in its own process) overlaps reading the weights, and packs the int4
matrices in the layout `int4_layout` expects meanwhile. At an engine's start a first build
(`built()` false) does not hold the start at all: `prefetch(background=True)` runs it at the
lowest priority, the runner serves on torch ops, and `TorchRunner.upgrade` routes the kernels
in once `ready()`. `load()` says why when it cannot build; the runner then serves on torch
ops and reports it (`--torch-cpu-kernels auto`), or refuses to start (`--torch-cpu-kernels
cpp`).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from ....errors import ModelLoadError
from . import model as M
from .qlinear import Int4Linear, StackedLinear

log = logging.getLogger("appliance.torch")

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
MAX_HEAD_DIM, MAX_GROUP = 256, 16
ORPHAN_WAIT_S = 300   # at most this long for a build another process left running

_lock = threading.Lock()
_loaded: dict[str, tuple[ModuleType | None, str]] = {}
_building: dict[str, threading.Thread] = {}


def cache_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "appliance" / "torch_ext"


@functools.cache
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
    return f"appliance_cpu_kernels_{h.hexdigest()[:16]}"


def prefetch(background: bool = False) -> None:
    """Start building or loading the kernels in a thread; `load()` then waits for it.
    background: the build at the lowest CPU priority (the thread's, which its compiler
    processes inherit), so that what runs meanwhile keeps the cores."""
    name = build_name()
    with _lock:
        if name in _loaded or name in _building:
            return
        _building[name] = threading.Thread(target=_niced_load if background else load, name="cpu-kernels-build",
                                           daemon=True)
        _building[name].start()


def _niced_load() -> None:
    try:   # Linux: a thread's own priority, inherited by the processes it starts
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    load()


def built() -> bool:
    """Whether this machine has the kernels built (on disk or in this process): `load` is then
    quick, where a first build takes ~14 s."""
    name = build_name()   # (no lock needed: a dict's read is atomic)
    return name in _loaded or any((cache_dir() / name).glob("*.so"))


def ready() -> bool:
    """Whether `load` returns at once: loaded, or `prefetch`'s build done (never blocks)."""
    name = build_name()   # no lock, as in built()
    building = _building.get(name)
    return name in _loaded or (building is not None and not building.is_alive())


def load() -> tuple[ModuleType | None, str]:
    """(the compiled module, "") or (None, why not). Built or loaded once per process."""
    name = build_name()
    with _lock:
        building = _building.get(name)
    if building is not None and building is not threading.current_thread():
        building.join()
    with _lock:
        if name in _loaded:
            return _loaded[name]
    # built without the lock, so that prefetch, built and ready never wait for a build (its flock
    # makes a second concurrent build wait for the first, then load what it built)
    result = _build(name)
    with _lock:
        return _loaded.setdefault(name, result)


def _build(name: str) -> tuple[ModuleType | None, str]:
    try:
        from torch.utils.cpp_extension import load as load_extension

        where = cache_dir() / name
        where.mkdir(parents=True, exist_ok=True)
        # torch's own build lock is a file it removes when done: a build killed midway leaves it
        # and every later load waits on it forever. An flock (released when its process dies)
        # guards the build across processes instead, and a `lock` found while holding it is stale.
        with open(where / "appliance.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            _wait_for_orphans(where)
            (where / "lock").unlink(missing_ok=True)
            if not any(where.glob("*.so")):
                log.info("building the CPU kernels (once per machine, about 15 s)")
            mod = load_extension(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                 extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
        return mod, ""
    except Exception as e:  # noqa: BLE001 - no compiler or ninja, a failed build: the ops path serves
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("the CPU kernels are not available (%s); the torch runner runs on torch ops", reason)
        return None, reason


def _wait_for_orphans(where: Path, timeout_s: float = ORPHAN_WAIT_S) -> None:
    """Wait for a build that a stopped engine left running in `where`: its ninja and compiler
    go on without it (and without its flock), and a second build beside them would write the
    same files. Found by their working directory (Linux's /proc; elsewhere none are seen)."""
    deadline = time.monotonic() + timeout_s
    while _working_in(where) and time.monotonic() < deadline:
        time.sleep(0.2)


def _working_in(where: Path) -> list[int]:
    """The processes whose working directory is `where`."""
    target, found = os.path.realpath(where), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd") == target:
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def unsupported(n_head: int, n_head_kv: int, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why the attention kernel cannot serve this model's attention (None: it can)."""
    if kv_dtype not in (torch.bfloat16, torch.float32):
        return f"KV dtype {kv_dtype} (the kernel reads bfloat16 or float32)"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (the kernel takes multiples of 16 up to {MAX_HEAD_DIM})"
    if n_head % n_head_kv or n_head // n_head_kv > MAX_GROUP:
        return f"{n_head} query heads on {n_head_kv} KV heads (at most {MAX_GROUP} a KV head)"
    return None


class CpuKernels:
    """The module's functions as model.py calls them. `operand`: the dtype the matmuls take
    (RMSNorm before a matmul and SwiGLU hand it over in it: the rounding the matmul's own
    conversion would do); `attend`: the short spans' attention, or None (torch ops)."""

    def __init__(self, mod: ModuleType, operand: torch.dtype, attention: bool) -> None:
        self.mod, self.bf16 = mod, operand == torch.bfloat16
        self.attend = mod.attend if attention else None
        self.int4 = self.bf16 and mod.int4_native()   # the int4 matmul (AVX512-BF16 builds)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """float32 out (the final norm's input to the logits, a MoE router's)."""
        return self.mod.rms_norm(x, weight, eps, False)

    def norm_operand(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Out in the matmuls' dtype: a norm whose only reader is a matmul."""
        return self.mod.rms_norm(x, weight, eps, self.bf16)

    def rope_(self, x: torch.Tensor, rot: torch.Tensor, dim: int, neox: bool) -> torch.Tensor:
        """x [N, heads, E] float32 rotated in place by rot [N, 1, E/2] complex64; x returned."""
        self.mod.rope_(x, torch.view_as_real(rot[:, 0]), dim, neox)
        return x

    def attend_span(self, qkv: torch.Tensor, rot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    start: int, rope_dim: int, neox: bool, n_head: int, scale: float) -> torch.Tensor:
        """A short span after its QKV matmul: qkv [T, H + 2G, E] float32 (contiguous), rot
        [T, 1, E/2] complex64, keys and values the slot's [G, n_ctx, E] -> the attention's
        output [T, H * E] in the matmuls' dtype, K and V stored at start.. (the same bits as
        `rope_`, `KVPool.write` and `attend` one by one)."""
        return self.mod.attend_span(qkv, torch.view_as_real(rot[:, 0]), rope_dim, neox, keys, values, start,
                                    scale, n_head, self.bf16)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2F] float32 -> silu(gate) * up, [N, F] in the matmuls' dtype."""
        return self.mod.swiglu(gate_up, self.bf16)


def choose(setting: str, device: torch.device, kernels: bool, args: M.ModelArgs,
           kv_dtype: torch.dtype, dtype: torch.dtype) -> tuple[CpuKernels | None, str]:
    """The CPU kernels (`--torch-cpu-kernels`), or None and why not (an empty reason: not asked
    for, or not a CPU path). Their attention serves short spans where its shapes allow; the
    reason says so where they do not (`cpp` then refuses to start)."""
    if setting == "ops":
        return None, ""
    if device.type != "cpu" or kernels:
        if setting == "cpp":
            raise ModelLoadError("--torch-cpu-kernels cpp: the C++ kernels are the CPU path's "
                                 f"(here: {device}{', the Triton kernels' if kernels else ''})")
        return None, ""
    mod, why = load()
    if mod is None:
        if setting == "cpp":
            raise ModelLoadError(f"--torch-cpu-kernels cpp: the C++ kernels did not build: {why}")
        return None, f"ops: {why}"
    attention = unsupported(args.n_head, args.n_head_kv, args.head_dim, kv_dtype)
    if attention is not None and setting == "cpp":
        raise ModelLoadError(f"--torch-cpu-kernels cpp: the C++ decode attention cannot serve this model: {attention}")
    note = f"attention on ops: {attention}" if attention is not None else ""
    return CpuKernels(mod, dtype, attention=attention is None), note


def int4_layout(setting: str) -> str:
    """The layout to pack int4 matrices in while the kernels build: "tiles" (their int4 matmul)
    where this CPU has the AVX512-BF16 it needs and they are asked for, else "torch". `use`
    repacks the few cases this guesses wrong (a compiler without AVX512-BF16, a failed build)."""
    flags = set(_cpu_flags().split())
    return "tiles" if setting != "ops" and {"avx512f", "avx512bw", "avx512_bf16"} <= flags else "torch"


def int4_linears(model) -> list[Int4Linear]:
    """The model's int4 matrices: attention, feed-forward (or router) and output (a
    `StackedLinear`'s parts each)."""
    owners = [model] + [o for b in model.blocks for o in (b.attn, b.ffn)]
    found = [v for o in owners for v in vars(o).values() if isinstance(v, (Int4Linear, StackedLinear))]
    return [p for v in found for p in (v.parts if isinstance(v, StackedLinear) else [v]) if isinstance(p, Int4Linear)]


def use(model, k: CpuKernels | None) -> None:
    """Route a model.Transformer's small per-row operations through `k`, or
    back to torch ops (None). A norm whose only reader is a matmul hands it its operand; a MoE
    block's feed-forward norm stays float32 (its router multiplies in float32). Its int4
    matrices are packed for `k`'s int4 matmul where it has one, else for torch's."""
    for lin in int4_linears(model):
        lin.use(k.mod if k is not None and k.int4 else None)
    model.final_norm = M.rms_norm if k is None else k.rms_norm
    for rope in (model.rope, model.rope_swa):
        if rope is not None:
            rope.cpu = k
    for b in model.blocks:
        b.norm = M.rms_norm if k is None else k.norm_operand
        b.norm_ffn = M.rms_norm if k is None else (k.norm_operand if isinstance(b.ffn, M.MLP) else k.rms_norm)
        plain = not b.attn.window and b.attn.sinks is None              # the kernels have no window, no sinks
        b.attn.cpu = k.attend if k is not None and plain else None
        # the one-call span (RoPE, KV store, attention) where no Q/K norm sits between
        b.attn.span = k if k is not None and k.attend is not None and b.attn.q_norm is None and plain else None
        if isinstance(b.ffn, M.MLP):
            b.ffn.act = None if k is None or b.ffn.gelu else k.swiglu
