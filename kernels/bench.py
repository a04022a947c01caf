"""Each kernel of this package timed against the device's memory-bandwidth limit, beside the
torch reference it is checked against (llm.c's `dev/cuda`: validate, then time, with the
napkin math next to the timing).

    python -m kernels.bench [--quick] [--json FILE] [--device cuda|cpu]

An entry is one kernel at one shape. Its output is first compared with the reference's once
(max |kernel - reference| over max |reference|, under a bound for the dtype the products are
taken in); a failing check prints FAIL and the entry is not timed. Then the kernel and the
reference are timed: the median of repeats after warm-up calls, with CUDA events on a GPU and
a 256 MiB buffer written before each repeat so no operand is served from L2, `perf_counter`
on CPU. Beside the time: the bytes the call must move at least (weights once, activations,
outputs; for attention the K/V it reads), the GB/s that makes, TFLOP/s for GEMMs (2 M N K),
the fraction of the device's bandwidth limit, and the speedup over the reference (for wgemm
the reference dequantizes, then multiplies in float32; a "dense bf16" line times a plain bf16
matmul of the same shape: the ceiling a weight-only GEMM is compared against).

The limit is the vendor's published figure for a device in `PUBLISHED_TB_S`, else a 1 GiB
device-to-device `copy_` timed as the empirical peak (read + write counted); the header says
which. On CPU (`--device cpu`, TRITON_INTERPRET=1) tiny shapes run under Triton's
interpreter: that proves the harness, and its timings say nothing about speed. A benchmark
never asserts speed: the exit status is 1 only when a check failed.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from . import decode_attention as da
from . import moe_gemm as mg
from . import norm_rope as nr
from . import wgemm as wg
from ._triton import INTERPRET, triton
from .formats import format_of
from .plan import rel_error

# The vendors' published memory bandwidth, TB/s: (pattern on the device's name, figure, what).
# The first match wins, so the narrower names come first; \b keeps "GH200" off "H200".
PUBLISHED_TB_S = (
    (r"\bH200\b", 4.8, "NVIDIA H200"),
    (r"\bH100\b.*\bPCIe\b", 2.0, "NVIDIA H100 PCIe"),
    (r"\bH100\b.*\bNVL\b", 3.9, "NVIDIA H100 NVL"),
    (r"\bH100\b", 3.35, "NVIDIA H100 SXM"),
    (r"\bA100\b.*\b80GB\b", 2.0, "NVIDIA A100 80GB"),
    (r"\bA100\b.*\b40GB\b", 1.55, "NVIDIA A100 40GB"),
    (r"\bRTX 4090\b", 1.008, "NVIDIA GeForce RTX 4090"),
    (r"\bRTX 3090\b(?! Ti)", 0.936, "NVIDIA GeForce RTX 3090"),
    (r"\bL40S\b", 0.864, "NVIDIA L40S"),
    (r"\bMI300X\b", 5.3, "AMD Instinct MI300X"),
)
# max |error| / max |reference| allowed, by the dtype the kernel's products are taken in: bf16
# rounds a decoded weight to 8 bits (2^-9 relative), fp16 to 11; float32 differs by order alone
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Limit:
    gb_s: float
    source: str       # "published" or "measured"
    label: str


def bandwidth_limit(name: str, measure: Callable[[], float]) -> Limit:
    """The device's bandwidth limit: the published figure when `name` is in the table, else
    `measure()` (GB/s), which is called only then."""
    for pattern, tb_s, what in PUBLISHED_TB_S:
        if re.search(pattern, name, re.IGNORECASE):
            return Limit(tb_s * 1000, "published", f"{what}: the vendor's published {tb_s:g} TB/s")
    return Limit(measure(), "measured", "no published figure for this device: a device-to-device "
                                        "torch copy_ timed, read + write counted")


@dataclass(frozen=True)
class Repeats:
    warmup: int
    kernel: int
    reference: int


class Timer:
    """The median time of a call: CUDA events on a GPU (L2 flushed before each repeat), else
    perf_counter."""

    def __init__(self, device: str, flush_bytes: int = 256 << 20):
        self.cuda = torch.device(device).type == "cuda"
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if self.cuda else None
        self.label = ("CUDA events, L2 flushed before each repeat" if self.cuda else
                      "perf_counter" + (" under TRITON_INTERPRET=1: interpreter timings, meaningless "
                                        "as speed" if INTERPRET else ""))

    def median(self, fn: Callable, warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def measure_copy_gb_s(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The empirical peak: dst.copy_(src) of `nbytes`, read + write counted."""
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = Timer(device, flush_bytes=0).median(lambda: dst.copy_(src), 2, repeats)
    return 2 * nbytes / t / 1e9


# ------------------------------------------------------------------------------- entries

@dataclass(frozen=True)
class Case:
    """One kernel at one shape; `setup` builds the inputs on the device and returns the
    kernel's call and the reference's (None: nothing to check, as for the dense ceiling)."""
    kernel: str
    shape: str
    bytes: int
    flops: int | None
    tol: float | None
    setup: Callable[[], tuple[Callable, Callable | None]]
    config: dict = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Entry:
    kernel: str
    shape: str
    check: str                 # "ok", "FAIL", or "-" (not checked)
    error: float | None        # max |kernel - reference| / max |reference|
    tol: float | None
    bytes: int
    flops: int | None
    time_s: float | None = None
    ref_time_s: float | None = None
    speedup: float | None = None
    gb_s: float | None = None
    tflop_s: float | None = None
    frac_limit: float | None = None
    config: dict = field(default_factory=dict)
    note: str = ""


def run_case(case: Case, timer: Timer, reps: Repeats, limit_gb_s: float) -> Entry:
    """Check, then time; a failing check (or a raising kernel) is a FAIL, not timed."""
    entry = Entry(case.kernel, case.shape, "-", None, case.tol, case.bytes, case.flops,
                  config=case.config, note=case.note)
    try:
        kernel, ref = case.setup()
        if ref is not None and case.tol is not None:
            err = rel_error(kernel(), ref())
            if not err <= case.tol:     # NaN fails too
                return replace(entry, check="FAIL", error=err,
                               note=f"max error {err:.3g} of the largest value > {case.tol:g}")
            entry = replace(entry, check="ok", error=err)
    except Exception as exc:  # a kernel that cannot run here is a failed check, not a crash
        return replace(entry, check="FAIL", note=f"{type(exc).__name__}: {exc}"[:300])
    try:
        t = timer.median(kernel, reps.warmup, reps.kernel)
        t_ref = timer.median(ref, min(reps.warmup, 1), reps.reference) if ref is not None else None
    except Exception as exc:  # checked, but a repeat failed (out of memory, say): say so
        return replace(entry, note=f"timing failed: {type(exc).__name__}: {exc}"[:300])
    gb_s = case.bytes / t / 1e9
    return replace(entry, time_s=t, ref_time_s=t_ref, speedup=t_ref / t if t_ref else None,
                   gb_s=gb_s, frac_limit=gb_s / limit_gb_s,
                   tflop_s=case.flops / t / 1e12 if case.flops else None)


# -------------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shapes:
    gemm_nk: tuple[tuple[int, int], ...]
    gemm_m: tuple[int, ...]
    formats: tuple[str, ...]
    decode_cfg: wg.GemmConfig             # M <= 16
    prefill_cfg: wg.GemmConfig
    attn_rows: tuple[int, ...]
    attn_keys: tuple[int, ...]
    heads: tuple[int, int, int]            # H, G, E
    kv_dtype: torch.dtype
    attn_cfg: da.DecodeAttentionConfig
    norm_n: tuple[int, ...]
    norm_c: int
    copy_bytes: int
    repeats: Repeats
    moe: tuple[tuple[int, int, int, int], ...] = ()   # (experts, used per token, D, F)
    moe_m: tuple[int, ...] = ()                       # tokens a call
    moe_formats: tuple[str | None, ...] = ()          # None: dense bf16 (the expert cache's pool)


ALL_FORMATS = ("q4_0", "q4_1", "q8_0", "mxfp4", "nvfp4")
_DECODE = wg.GemmConfig(block_m=16, block_n=64, block_k=128, split_k=4)     # 64 N-tiles x 4 splits
_PREFILL = wg.GemmConfig(block_m=64, block_n=64, block_k=64)
SHAPES = {
    "full": Shapes(((4096, 4096), (14336, 4096)), (1, 4, 16, 512), ALL_FORMATS, _DECODE, _PREFILL,
                   (1, 8, 32), (1024, 8192, 32768), (32, 8, 128), torch.bfloat16,
                   da.DecodeAttentionConfig(), (1, 512), 4096, 1 << 30, Repeats(3, 20, 5),
                   ((128, 8, 2048, 768),), (1, 16, 512), ("q4_0", "mxfp4", "nvfp4", None)),
    "quick": Shapes(((4096, 4096),), (1, 512), ALL_FORMATS, _DECODE, _PREFILL, (1, 32), (8192,),
                    (32, 8, 128), torch.bfloat16, da.DecodeAttentionConfig(), (1, 512), 4096,
                    1 << 30, Repeats(2, 10, 3), ((128, 8, 2048, 768),), (1, 512), ("nvfp4", None)),
    # the interpreter: a few programs a call, float16 pools (it mishandles bfloat16)
    "tiny": Shapes(((32, 128),), (1, 20), ALL_FORMATS,
                   wg.GemmConfig(block_m=16, block_n=32, block_k=64, split_k=2),
                   wg.GemmConfig(block_m=32, block_n=32, block_k=64), (1, 2), (40,), (4, 2, 16),
                   torch.float16, da.DecodeAttentionConfig(block_n=16, split_keys=32), (1, 3), 64,
                   16 << 20, Repeats(0, 1, 1), ((4, 2, 64, 32),), (1, 5), ("q8_0", None)),
}


def random_blocks(fmt: str, n: int, k: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Random raw rows uint8 [N, row_bytes] of `fmt`, with scales in a sane range (random
    bytes there would make NaN and Inf f16 scales)."""
    f = format_of(fmt)
    nb = k // f.block
    b = torch.randint(0, 256, (n, nb, f.nbytes), dtype=torch.uint8, generator=gen, device=device)

    def f16(lo: float, hi: float) -> torch.Tensor:      # [N, nb, 2]: little-endian f16 bytes
        v = torch.rand(n, nb, generator=gen, device=device) * (hi - lo) + lo
        return v.half().view(torch.uint8).reshape(n, nb, 2)

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, (n, nb, *shape), generator=gen, device=device).to(torch.uint8)

    if fmt in ("q4_0", "q4_1", "q8_0"):
        b[..., 0:2] = f16(2 ** -8, 2 ** -6)
    if fmt == "q4_1":
        b[..., 2:4] = f16(-2 ** -3, -2 ** -5)            # m about -8 d: roughly zero-mean rows
    if fmt == "mxfp4":
        b[..., 0] = ints(118, 126)
    if fmt == "nvfp4":                                    # UE4M3 exponents 2..8, never 0x7F
        b[..., 0:4] = (ints(2, 9, 4) << 3) | ints(0, 8, 4)
    return b.reshape(n, nb * f.nbytes)


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def gemm_cases(s: Shapes, device: str) -> list[Case]:
    x_dtype = torch.float32 if INTERPRET else torch.bfloat16     # the interpreter: float32 only
    cases = []
    for n, k in s.gemm_nk:
        for m in s.gemm_m:
            cfg = s.decode_cfg if m <= 16 else s.prefill_cfg
            dot = "float32" if INTERPRET or cfg.dot == "fp32" else {"bf16": "bfloat16", "fp16": "float16"}[cfg.dot]
            for fmt in s.formats:
                cases.append(_wgemm_case(fmt, m, n, k, x_dtype, cfg, dot, device))
            cases.append(_dense_case(m, n, k, device))
    return cases


def _wgemm_case(fmt, m, n, k, x_dtype, cfg, dot, device) -> Case:
    tol = TOLERANCE[dot]

    def setup():
        gen = _gen(device, 17 * m + n + k)
        raw = random_blocks(fmt, n, k, gen, device)
        x = torch.randn(m, k, generator=gen, device=device).to(x_dtype)
        return (lambda: wg.wgemm(x, raw, fmt, k, cfg)), (lambda: wg.wgemm_torch(x, raw, fmt, k))
    return Case(f"wgemm {fmt}", f"M={m} N={n} K={k}", wg.bytes_moved(m, n, k, fmt, x_dtype.itemsize),
                2 * m * n * k, tol, setup, cfg.as_dict(), note=f"products in {dot}")


def _dense_case(m, n, k, device) -> Case:
    def setup():
        gen = _gen(device, m + n + k)
        x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen, device=device).to(torch.bfloat16)
        return (lambda: x @ w.T), None
    return Case("dense bf16", f"M={m} N={n} K={k}", 2 * (n * k + m * k + m * n), 2 * m * n * k, None,
                setup, note="torch matmul, bf16 weights: the ceiling")


def moe_cases(s: Shapes, device: str) -> list[Case]:
    return [_moe_case(fmt, m, *shape, device) for shape in s.moe for m in s.moe_m for fmt in s.moe_formats]


def _moe_case(fmt, m, n_expert, top_k, d, f, device) -> Case:
    """The gate/up launch of one MoE layer: m tokens routed to top_k of n_expert experts each,
    gate and up stacked [X, 2F, D] (a layer's down launch is the same call at [X, D, F])."""
    x_dtype = torch.float32 if INTERPRET else torch.bfloat16
    dot = "float32" if INTERPRET else "bfloat16"
    cfg = wg.GemmConfig(block_m=16, block_n=64, block_k=128, dot="fp32" if INTERPRET else "bf16")
    gen = torch.Generator().manual_seed(m + n_expert + d)
    chosen = torch.stack([torch.randperm(n_expert, generator=gen)[:top_k] for _ in range(m)])
    order = torch.argsort(chosen.flatten(), stable=True)
    rows, counts = (order // top_k).numpy(), torch.bincount(chosen.flatten(), minlength=n_expert).numpy()
    used = int((counts > 0).sum())

    def setup():
        g = _gen(device, m + d + f)
        if fmt is None:
            w = (torch.randn(n_expert, 2 * f, d, generator=g, device=device) * 0.02).to(x_dtype)
        else:
            w = torch.stack([random_blocks(fmt, 2 * f, d, g, device) for _ in range(n_expert)])
        x = torch.randn(m, d, generator=g, device=device).to(x_dtype)
        r = mg.route(rows, counts, range(n_expert), cfg.block_m, device)
        return (lambda: mg.moe_gemm(x, w, r, fmt, d, cfg)), (lambda: mg.moe_gemm_torch(x, w, r, fmt, d))
    label = fmt or ("bf16" if not INTERPRET else "f32")
    moved = mg.bytes_moved(m * top_k, used, 2 * f, d, fmt, x_dtype.itemsize, x_dtype.itemsize)
    return Case(f"moe_gemm {label}", f"T={m} X={n_expert} k={top_k} N={2 * f} K={d}", moved,
                2 * m * top_k * 2 * f * d, TOLERANCE[dot], setup, cfg.as_dict(),
                note=f"{used} experts used; products in {dot}")


def attention_cases(s: Shapes, device: str) -> list[Case]:
    h, g, e = s.heads
    return [_attention_case(r, n, h, g, e, s.kv_dtype, s.attn_cfg, device)
            for n in s.attn_keys for r in s.attn_rows]


def _attention_case(rows, keys, h, g, e, kv_dtype, cfg, device) -> Case:
    def setup():
        gen = _gen(device, rows * 7 + keys)
        k_pool, v_pool = (torch.randn(1, rows, g, keys, e, generator=gen, device=device, dtype=kv_dtype)
                          for _ in "kv")                 # [n_layer, n_slots, G, n_ctx, E]
        q = torch.randn(rows, h, e, generator=gen, device=device)
        slots = torch.arange(rows, device=device)
        pos = torch.full((rows,), keys - 1, dtype=torch.int64, device=device)   # every key read
        args = (q, k_pool, v_pool, 0, slots, pos, e ** -0.5)
        return (lambda: da.decode_attention(*args, cfg)), (lambda: da.decode_attention_torch(*args))
    kv = 2 * rows * keys * g * e * kv_dtype.itemsize
    return Case("decode_attention", f"R={rows} L={keys} H={h} G={g} E={e} {str(kv_dtype)[6:]}",
                kv + 2 * rows * h * e * 4, None, TOLERANCE["float32"], setup,
                dict(cfg.__dict__), note="the wrapper reads positions on the host: one sync a call")


def norm_cases(s: Shapes, device: str) -> list[Case]:
    h, g, e = s.heads
    return ([_rms_case(n, s.norm_c, device) for n in s.norm_n]
            + [_rope_case(n, h, g, e, device) for n in s.norm_n])


def _rms_case(n, c, device) -> Case:
    def setup():
        gen = _gen(device, n + c)
        x = torch.randn(n, c, generator=gen, device=device)       # the float32 residual stream
        w = torch.randn(c, generator=gen, device=device)
        return (lambda: nr.rms_norm(x, w, 1e-5)), (lambda: nr.rms_norm_torch(x, w, 1e-5))
    return Case("rms_norm", f"N={n} C={c} f32", (2 * n * c + c) * 4, None, TOLERANCE["float32"], setup)


def _rope_case(n, h, g, e, device) -> Case:
    def setup():
        gen = _gen(device, n + h + g + e)
        qk = torch.randn(n, h + 2 * g, e, generator=gen, device=device)[:, :h + g]  # a view of QKV
        pos = torch.randint(0, 32768, (n,), generator=gen, device=device)
        inv_freq = 1e6 ** (-torch.arange(0, e, 2, dtype=torch.float64, device=device) / e)
        cos, sin = nr.rope_tables(pos, inv_freq)
        qn, kn = (1 + 0.1 * torch.randn(e, generator=gen, device=device) for _ in "qk")
        args = (qk, h, cos, sin, "neox", e, qn, kn)
        return (lambda: nr.qk_norm_rope(*args)), (lambda: nr.qk_norm_rope_torch(*args))
    moved = (2 * n * (h + g) * e + n * e + 2 * e) * 4              # qk in and out, cos/sin, weights
    return Case("qk_norm_rope", f"N={n} H={h} G={g} E={e} f32", moved, None, TOLERANCE["float32"],
                setup, note="neox, rope_dim = E, q_norm and k_norm")


def plan(shapes: Shapes, device: str) -> list[Case]:
    return (gemm_cases(shapes, device) + moe_cases(shapes, device) + attention_cases(shapes, device)
            + norm_cases(shapes, device))


# ---------------------------------------------------------------------------------- report

@dataclass(frozen=True)
class Report:
    device: str
    device_type: str
    mode: str
    interpreter: bool
    timing: str
    limit: Limit
    copy_gb_s: float | None
    versions: dict
    entries: tuple[Entry, ...]

    @property
    def failed(self) -> int:
        return sum(e.check == "FAIL" for e in self.entries)

    def as_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


COLUMNS = ("kernel", "shape", "check", "error", "us", "ref us", "x ref", "MB", "GB/s", "TFLOP/s", "limit")
_WIDTHS = (17, 34, 5, 8, 10, 11, 8, 9, 8, 8, 7)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_line(e: Entry) -> str:
    cells = (e.kernel, e.shape, e.check, _fmt(e.error, ".1e"), _fmt(e.time_s and e.time_s * 1e6, ".1f"),
             _fmt(e.ref_time_s and e.ref_time_s * 1e6, ".1f"), _fmt(e.speedup, ".2f"),
             _fmt(e.bytes / 1e6, ".4g"), _fmt(e.gb_s, ".1f"), _fmt(e.tflop_s, ".2f"),
             _fmt(e.frac_limit and e.frac_limit * 100, ".1f") + ("%" if e.frac_limit is not None else ""))
    line = " ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, _WIDTHS)))
    return line + (f"  {e.note}" if e.check == "FAIL" or e.note.startswith("timing failed") else "")


def header(r: Report, reps: Repeats) -> list[str]:
    copy = f"; copy_ measured {r.copy_gb_s:.0f} GB/s" if r.copy_gb_s and r.limit.source == "published" else ""
    return [f"device: {r.device} ({r.device_type}), {r.mode} shapes",
            f"bandwidth limit: {r.limit.gb_s:.0f} GB/s, {r.limit.source} ({r.limit.label}){copy}",
            f"timing: {r.timing}; median of {reps.kernel} after {reps.warmup} warm-up "
            f"(references: {reps.reference})",
            "MB: what a call must move; x ref: reference time / kernel time; limit: GB/s over the "
            "limit; decode_attention's times include its one host sync a call",
            " ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(COLUMNS, _WIDTHS)))]


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def run(shapes: Shapes | str, device: str, out: Callable[[str], None] = print,
        measure: Callable[[], float] | None = None) -> Report:
    """Every case of `shapes` on `device`, printed line by line as it runs; the report."""
    mode = shapes if isinstance(shapes, str) else "custom"
    s = SHAPES[shapes] if isinstance(shapes, str) else shapes
    measured: list[float] = []

    def copy_gb_s() -> float:
        if not measured:
            measured.append(measure() if measure else measure_copy_gb_s(device, s.copy_bytes))
        return measured[0]

    name = device_name(device)
    limit = bandwidth_limit(name, copy_gb_s)
    if torch.device(device).type == "cuda":
        copy_gb_s()                                # shown beside a published figure too
    timer = Timer(device)
    report = Report(name, torch.device(device).type, mode, INTERPRET, timer.label, limit,
                    measured[0] if measured else None,
                    {"torch": torch.__version__, "triton": getattr(triton, "__version__", None)}, ())
    for line in header(report, s.repeats):
        out(line)
    entries = []
    for case in plan(s, device):
        entries.append(run_case(case, timer, s.repeats, limit.gb_s))
        out(table_line(entries[-1]))
    report = replace(report, entries=tuple(entries))
    out(f"{len(entries)} entries, {report.failed} FAIL")
    return report


def unusable(device: str) -> str | None:
    """Why the kernels cannot launch on `device` in this process, or None."""
    if triton is None:
        return "Triton is not installed: no kernel to time"
    if device == "cpu" and not INTERPRET:
        return "--device cpu runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1"
    if device == "cuda" and INTERPRET:
        return "TRITON_INTERPRET=1 runs CPU tensors only: unset it for --device cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here (--device cpu with TRITON_INTERPRET=1 proves the harness)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    help="default: cuda when there is one; cpu runs tiny shapes interpreted")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
    problem = unusable(device)
    if problem:
        print(f"kernels.bench: {problem}", file=sys.stderr)
        return 2
    report = run("tiny" if device == "cpu" else "quick" if args.quick else "full", device)
    if args.json:
        Path(args.json).write_text(report.as_json())
        print(f"report: {args.json}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
