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

from ._triton import INTERPRET, triton
from .bench_cases import SHAPES, Case, Repeats, Shapes, plan
from .gemm_trial import rel_error

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
