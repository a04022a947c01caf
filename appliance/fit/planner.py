"""The fit planner: a pure function from a model's tensor table, the context asked for, and the
devices' memory to a placement, in llama.cpp's own terms.

llama.cpp places a model by layer, counting the output layer as the last one: with
`n_gpu_layers = N` the output and the last N - 1 repeating layers (their weights and their KV)
sit on the GPU (N = n_layer + 1: all); the input embedding always stays in host memory. `tensor_buft_overrides` (llama-server's `-ot
REGEX=DEVICE`) then move single tensors, matched by the first pattern that finds the name.

Scarce device memory goes, in this order, to attention and the layers' other small weights
with their KV, then to dense FFNs, then to routed experts (each token reads k of them, so they
cost the least to leave in host memory). So when everything does not fit on the GPU the planner
walks one path, from most on the GPU to least, and takes the first step that fits:

    1. the routed experts of layers 0, 1, ... stay in host memory  (llama-server --n-cpu-moe K)
    2. then the dense FFNs of layers 0, 1, ...                    (-ot blk.K.ffn_(gate|up|down))
    3. then whole layers from the front, with their KV, the output last  (n_gpu_layers < all)

A choice the user made (n_gpu_layers, cpu_moe, n_cpu_moe, overrides) is kept fixed and only the
rest is walked. On an APU the GPU's memory is host memory: what it holds past its carve-out
counts against the host's share too. When nothing fits, `suggest` says what would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .devices import GIB, Device
from .model import TIED_OUTPUT, ModelFacts
from .gguf_header import nbytes

KV_TYPES = ("f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class FitRequest:
    n_ctx: int                                 # positions per slot
    n_slots: int = 1
    kv_type: str = "f16"
    n_ubatch: int = 512
    flash_attn: bool = False                   # llama.cpp's flash attention (on for a quantised KV)
    n_gpu_layers: int | None = None            # None: choose; n_layer + 1 or more: all
    n_cpu_moe: int | None = None               # None: choose; the experts of layers < K in host memory
    overrides: tuple[tuple[str, str], ...] = ()  # (regex, device name), first match wins
    projector: tuple[int, bool] = (0, False)   # a vision projector's bytes, and whether it goes on the GPU
    tensor_split: tuple[float, ...] = ()       # the GPUs' shares of the layers (default: by budget)
    kv_unified: bool = False                   # one pool of n_ctx positions for every slot (--kv-unified)

    @property
    def streams(self) -> int:
        """KV streams of n_ctx positions: one per slot, or one shared pool."""
        return 1 if self.kv_unified else self.n_slots



def projector_of(cfg: Any) -> tuple[int, bool]:
    """--mmproj's bytes (its file's size) and whether it goes on the GPU: FitRequest.projector."""
    path = getattr(cfg, "mmproj", None)
    try:
        return (Path(path).stat().st_size if path else 0), bool(getattr(cfg, "mmproj_offload", True))
    except OSError:
        return 0, False    # a missing file: its load says so


@dataclass(frozen=True)
class Use:
    """What one device holds."""

    weights: dict[str, int]                    # by role
    kv: int
    compute: int
    budget: int

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv + self.compute

    @property
    def headroom(self) -> int:
        return self.budget - self.total


@dataclass(frozen=True)
class Placement:
    fits: bool
    request: FitRequest
    n_gpu_layers: int
    n_cpu_moe: int
    n_cpu_ffn: int
    gpu: str | None                            # the first device layers go to (None: CPU only)
    where: dict[str, str]                      # tensor name -> device name
    use: dict[str, Use]                        # device name -> what it holds
    layers: dict[int, str]                     # layer -> device of its attention and KV
    overrides: tuple[tuple[str, str], ...]     # what to pass llama.cpp, the user's first
    notes: tuple[str, ...] = field(default=())
    split: dict[str, float] = field(default_factory=dict)   # several GPUs: each one's share, as llama.cpp takes it

    def to_dict(self) -> dict:
        return {"fits": self.fits, "n_gpu_layers": self.n_gpu_layers, "n_cpu_moe": self.n_cpu_moe,
                "n_cpu_ffn": self.n_cpu_ffn, "gpu": self.gpu,
                "split": {g: round(x / sum(self.split.values()), 4) for g, x in self.split.items()}, "kv_type": self.request.kv_type,
                "n_ctx": self.request.n_ctx, "n_slots": self.request.n_slots, "kv_unified": self.request.kv_unified,
                "overrides": [f"{p}={d}" for p, d in self.overrides], "notes": list(self.notes),
                "devices": {name: {"weights": u.weights, "kv": u.kv, "compute": u.compute, "total": u.total,
                                   "budget": u.budget, "headroom": u.headroom} for name, u in self.use.items()}}


# -- sizes ----------------------------------------------------------------------------------

def kv_bytes(m: ModelFacts, layer: int, req: FitRequest) -> int:
    """K and V of one layer for every slot: llama.cpp's pool (a sliding-window layer keeps its
    window and one micro-batch per stream, a shared pool every sequence's window)."""
    positions = req.n_ctx
    if layer in m.swa_layers:
        positions = min(req.n_ctx, m.sliding_window * (req.n_slots if req.kv_unified else 1) + req.n_ubatch)
    per_pos = m.n_head_kv[layer] * (m.key_length + m.value_length)
    return req.streams * nbytes(req.kv_type.upper(), positions * per_pos)


def compute_bytes(m: ModelFacts, req: FitRequest, has_output: bool, has_layers: bool) -> int:
    """llama.cpp's compute buffer on a device, estimated from what dominates it: its allocator
    reuses memory across the graph, so the peak is the larger of the logits of one micro-batch
    (where the output layer is) and, without flash attention, one layer's attention scores
    over a slot's context (float32, n_kv x n_ubatch x n_head), plus the micro-batch's
    activations. Checked against llama.cpp's own report by scripts/placement_check.py."""
    if not (has_output or has_layers):
        return 0
    f32, ub = 4, min(req.n_ubatch, req.n_ctx * req.streams)   # llama.cpp clamps the batch to the context
    logits = f32 * ub * m.n_vocab if has_output else 0
    scores = f32 * ub * req.n_ctx * m.n_head if has_layers and not req.flash_attn else 0
    acts = f32 * ub * (8 * m.n_embd + 2 * m.n_ff) if has_layers else 0
    return max(logits, scores) + acts


def offload_compute_bytes(m: ModelFacts, req: FitRequest, where: dict[str, str]) -> int:
    """The GPU's compute buffer in a GPU build: llama.cpp's scheduler runs every op of a batch of
    32 tokens or more on the GPU, whatever holds its weights ("op offload"), so the GPU's buffer
    holds the whole graph's peak, output included, wherever the layers are, and a copy of the
    host-resident weights of the op it runs: the output's beside the logits, or one layer's."""
    by_layer: dict[int | None, int] = {}
    for t in m.tensors:
        if where[t.name] == "CPU" and t.role != "embed":        # the embedding is a row lookup, kept on the host
            by_layer[t.layer] = by_layer.get(t.layer, 0) + t.nbytes
    f32, ub = 4, min(req.n_ubatch, req.n_ctx * req.streams)
    logits = f32 * ub * m.n_vocab + by_layer.pop(None, 0)
    scores = f32 * ub * req.n_ctx * m.n_head if not req.flash_attn else 0
    acts = f32 * ub * (8 * m.n_embd + 2 * m.n_ff)
    return max(logits, scores + max(by_layer.values(), default=0)) + acts


def host_compute_bytes(m: ModelFacts, req: FitRequest) -> int:
    """The host's compute buffer beside a GPU: what the CPU computes itself for a micro-batch
    (the embedding rows and what the GPU reads back: about 2.5 float32 rows of n_embd a token),
    the batch's inputs (ids, positions, output rows) and the attention mask over a slot's
    context (float32; float16 with flash attention, and less of the rest). Fitted on llama.cpp's
    Vulkan backend (its Vulkan_Host buffer) at 256 to 2048 positions: within 5% for the embedded
    model and the tiny MoE; with flash attention within 3% for the embedded model."""
    ub = min(req.n_ubatch, req.n_ctx * req.streams)
    if req.flash_attn:
        return ub * (8 * m.n_embd + 128 + 2 * req.n_ctx)
    return ub * (10 * m.n_embd + 512 + 4 * req.n_ctx)


# -- one placement ----------------------------------------------------------------------------

def _layer_device(m: ModelFacts, ngl: int, gpus: list[str], split: list[float]) -> dict[int | None, str]:
    """llama.cpp's rule (llama-model.cpp, `i_gpu_start = n_layer + 1 - n_gpu_layers`): the output
    (key None) is layer n_layer, so `ngl` layers on the GPUs are the output and the last ngl - 1;
    across several GPUs, layer il goes to the first whose cumulative share of the split exceeds
    (il - i_gpu_start) / ngl, computed in float32 as llama.cpp does."""
    ngl = min(ngl, m.n_layer + 1) if gpus else 0
    first = m.n_layer + 1 - ngl
    bounds = np.cumsum(np.asarray(split or [1.0], dtype=np.float32), dtype=np.float32)
    bounds = bounds / bounds[-1]

    def device(il: int) -> str:
        if il < first:
            return "CPU"
        k = int(np.searchsorted(bounds, np.float32(il - first) / np.float32(ngl), side="right"))
        return gpus[min(k, len(gpus) - 1)]
    out: dict[int | None, str] = {i: device(i) for i in range(m.n_layer)}
    out[None] = device(m.n_layer)
    return out


def split_of(req: FitRequest, devices: list[Device]) -> list[float]:
    """The GPUs' shares of the layers: the user's --tensor-split, else each GPU's budget (as
    llama.cpp's default split by free memory). The runner passes it to llama.cpp as it is."""
    gpus = [d for d in devices if d.kind == "gpu"]
    if req.tensor_split:
        if len(req.tensor_split) != len(gpus) or min(req.tensor_split) < 0 or sum(req.tensor_split) <= 0:
            raise ValueError(f"--tensor-split {','.join(f'{x:g}' for x in req.tensor_split)}: one non-negative "
                             f"share per GPU ({', '.join(d.name for d in gpus) or 'none'}), not all zero")
        return list(req.tensor_split)
    return [float(max(d.budget, 1)) for d in gpus]


def _overrides(m: ModelFacts, n_cpu_moe: int, n_cpu_ffn: int, user: tuple[tuple[str, str], ...]):
    out = list(user)
    if n_cpu_moe:
        out.append((_layers_regex(n_cpu_moe, m.n_layer) + r"\.ffn_(up|down|gate|gate_up)_exps", "CPU"))
    if n_cpu_ffn:
        out.append((_layers_regex(n_cpu_ffn, m.n_layer) + r"\.ffn_(up|down|gate)(_shexp)?\.", "CPU"))
    return tuple(out)


def _layers_regex(k: int, n_layer: int) -> str:
    if k >= n_layer:
        return r"blk\.\d+"
    return r"blk\.(" + "|".join(str(i) for i in range(k)) + ")"


def place(m: ModelFacts, req: FitRequest, devices: list[Device], ngl: int, n_cpu_moe: int,
          n_cpu_ffn: int) -> Placement:
    """One placement, exactly as llama.cpp would make it from these settings, and its sizes."""
    gpus = [d.name for d in devices if d.kind == "gpu"]
    split = split_of(req, devices)
    by_layer = _layer_device(m, ngl, gpus, split)
    gpu = next((by_layer[i] for i in [*range(m.n_layer), None] if by_layer[i] != "CPU"), gpus[0] if gpus else None)
    overrides = _overrides(m, n_cpu_moe, n_cpu_ffn, req.overrides)
    compiled = [(re.compile(p), d) for p, d in overrides]
    where = {}
    for t in m.tensors:
        dev = "CPU" if t.role == "embed" else by_layer[t.layer]
        for rx, d in compiled:
            if rx.search(t.name):
                dev = d
                break
        where[t.name] = dev
    use = _sizes(m, req, devices, where, by_layer)
    fits, notes = _check(use, devices)
    return Placement(fits, req, ngl if gpu else 0, n_cpu_moe, n_cpu_ffn, gpu, where, use,
                     {i: by_layer[i] for i in range(m.n_layer)}, overrides, tuple(notes),
                     dict(zip(gpus, split)) if len(gpus) > 1 else {})


def _sizes(m: ModelFacts, req: FitRequest, devices: list[Device], where: dict[str, str],
           by_layer: dict[int | None, str]) -> dict[str, Use]:
    gpus = [d for d in devices if d.kind == "gpu"]
    # the local GPU llama.cpp's scheduler hands a big batch's ops to (an RPC device takes none)
    offload = next((d.name for d in gpus if not d.remote), None)
    first = gpus[0].name if gpus else None
    use = {}
    for d in devices:
        weights = {r: 0 for r in ("embed", "output", "attn", "ffn", "expert", "projector")}
        for t in m.tensors:
            if where[t.name] == d.name and not (t.name == TIED_OUTPUT and d.kind == "cpu"):
                weights[t.role] += t.nbytes  # a tied output in host memory is the embedding's mmap
        size, on_gpu = req.projector    # mtmd puts the whole projector on one device (its buffers not counted)
        weights["projector"] = size if (d.name == first) == (on_gpu and first is not None) else 0
        kv = sum(kv_bytes(m, i, req) for i in range(m.n_layer) if by_layer[i] == d.name)
        has_layers = any(by_layer[i] == d.name for i in range(m.n_layer))
        has_output = by_layer[None] == d.name
        if d.name == offload:                   # a GPU build: the big batches run on the GPU
            compute = offload_compute_bytes(m, req, where)
        elif d.kind == "cpu" and offload is not None:
            compute = host_compute_bytes(m, req)
        else:
            compute = compute_bytes(m, req, has_output, has_layers)
        use[d.name] = Use(weights, kv, compute, d.budget)
    return use


def _check(use: dict[str, Use], devices: list[Device]) -> tuple[bool, list[str]]:
    notes, fits = [], True
    for d in devices:
        u = use[d.name]
        if u.headroom < 0:
            fits = False
            notes.append(f"{d.name} needs {u.total / GIB:.2f} GiB, {-u.headroom / GIB:.2f} GiB more than "
                         f"its {d.budget / GIB:.2f} GiB ({d.how})")
    cpu = next(d for d in devices if d.kind == "cpu")
    for d in devices:
        if d.unified:
            from_host = use[cpu.name].total + max(0, use[d.name].total - d.carve_out)
            if from_host > cpu.budget:
                fits = False
                notes.append(f"{d.name} maps host memory: host and GPU together need {from_host / GIB:.2f} GiB "
                             f"of the host's {cpu.budget / GIB:.2f} GiB")
    return fits, notes


# -- the walk ---------------------------------------------------------------------------------

def candidates(m: ModelFacts, req: FitRequest, has_gpu: bool):
    """(n_gpu_layers, n_cpu_moe, n_cpu_ffn) from most on the GPU to least, the user's fixed."""
    all_layers = m.n_layer + 1
    if not has_gpu:
        yield 0, req.n_cpu_moe or 0, 0   # the user's --n-cpu-moe is still passed on, as llama-server does
        return
    moe_steps = [req.n_cpu_moe] if req.n_cpu_moe is not None else \
        (list(range(m.n_layer + 1)) if m.is_moe else [0])
    last_moe = moe_steps[-1]
    ngl_fixed = req.n_gpu_layers
    top = all_layers if ngl_fixed is None else min(ngl_fixed, all_layers)
    for k in moe_steps:
        yield top, k, 0
    has_dense = any(t.role == "ffn" for t in m.tensors)
    for f in range(1, m.n_layer + 1) if has_dense else ():
        yield top, last_moe, f
    if ngl_fixed is None:
        for ngl in range(m.n_layer, -1, -1):
            yield ngl, last_moe, m.n_layer if has_dense else 0


def plan(m: ModelFacts, req: FitRequest, devices: list[Device]) -> Placement:
    """The placement with the most on the GPU that fits; when none fits, the one with the least
    on the GPU (its notes say by how much it misses), with `suggest`'s alternatives in its notes."""
    has_gpu = any(d.kind == "gpu" for d in devices)
    last = None
    for ngl, k, f in candidates(m, req, has_gpu):
        last = place(m, req, devices, ngl, k, f)
        if last.fits:
            return replace(last, notes=last.notes + tuple(_apu_notes(m, req, devices, last)))
    assert last is not None
    return replace(last, notes=last.notes + tuple(suggest(m, req, devices)))


def _apu_notes(m: ModelFacts, req: FitRequest, devices: list[Device], p: Placement) -> list[str]:
    """On an APU, a model kept partly in host memory by the GTT limit alone: the kernel setting."""
    gpu = next((d for d in devices if d.name == p.gpu), None)
    if gpu is None or not gpu.gtt or p.n_gpu_layers > m.n_layer and not p.n_cpu_moe and not p.n_cpu_ffn:
        return []
    full = place(m, req, devices, m.n_layer + 1, 0, 0)
    need = full.use[gpu.name].total - gpu.carve_out
    host = next(d for d in devices if d.kind == "cpu")
    if full.use[host.name].total + need > host.budget:
        return []  # the host's memory, not the GTT limit, is what keeps it off
    pages = -(-(need + GIB) // GIB) * GIB // 4096
    return [f"{gpu.name} is an APU: the GPU maps host memory, and its GTT limit keeps part of the model "
            f"off it; the whole model needs {need / GIB:.1f} GiB of GTT. Add ttm.pages_limit={pages} "
            f"(4 KiB pages) to the kernel command line and reboot (amdgpu.gttsize is deprecated)"]


def suggest(m: ModelFacts, req: FitRequest, devices: list[Device]) -> list[str]:
    """What would fit when the request does not: a smaller KV type, fewer slots, a shorter
    context (each alone, the first of each kind that fits)."""
    has_gpu = any(d.kind == "gpu" for d in devices)

    def fits(r: FitRequest) -> bool:
        return any(place(m, r, devices, *c).fits for c in candidates(m, r, has_gpu))
    out = []
    for kv in KV_TYPES[KV_TYPES.index(req.kv_type) + 1:] if req.kv_type in KV_TYPES else ():
        if fits(replace(req, kv_type=kv, flash_attn=True)):   # llama.cpp needs it for a quantised V
            out.append(f"would fit with --kv-type {kv}")
            break
    for flag, values in (("--n-slots", _halvings(req.n_slots, 1)), ("--n-ctx", _halvings(req.n_ctx, 512))):
        key = "n_slots" if flag == "--n-slots" else "n_ctx"
        good = next((v for v in values if fits(replace(req, **{key: v}))), None)
        if good is not None:
            out.append(f"would fit with {flag} {good}")
    if not req.kv_unified and req.n_slots > 1 and fits(replace(req, kv_unified=True)):
        out.append("would fit with --kv-unified (the slots share one pool of --n-ctx positions)")
    if not out:
        out.append(f"does not fit this host at any of those settings: the weights alone are "
                   f"{m.weight_bytes / GIB:.1f} GiB")
    return out


def _halvings(n: int, floor: int) -> list[int]:
    """n // 2, n // 4, ... down to `floor`."""
    out = []
    while n // 2 >= floor:
        n //= 2
        out.append(n)
    return out
