"""One candidate GEMM configuration put to the test, for `plan.search`: the candidates `tune`
tries, in order; a random weight quantized by the format's own quantizer and one fixed random
activation matrix; the check against `wgemm_torch` (max |y - ref| / max |ref| within
`TOLERANCE` of the dot type, and, in a larger bucket, the decode winner's rows reproduced bit
for bit); and the timer (CUDA events with L2 flushed before each repeat on a GPU, perf_counter
on CPU). `rel_error` is also what kernels/bench.py checks each kernel with.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._triton import INTERPRET
from .formats import Format, format_of, quantize_nvfp4_torch
from .wgemm import GemmConfig, wgemm_torch

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}   # max |y - ref| / max |ref| by dot type


def candidates(fmt, dot: str = "bf16", small: bool = False) -> list[GemmConfig]:
    """The configurations `tune` tries, in order (near-ties go to the earlier one; the first is
    `wgemm.DEFAULT`). Decode-shaped ones (block_m 16) vary block_n, block_k and split_k; the
    batch-shaped ones vary block_m, block_n, warps and stages, their block_k/split_k being
    replaced by the decode winner's anyway. The dot type is not searched: it is a precision
    choice, not a speed knob. `small`: three configs for interpreter runs (tests)."""
    f = format_of(fmt)
    ks = [bk for bk in (128, 64, 256) if bk % f.block == 0 or (f.block == 256 and 256 % bk == 0)]   # a K-quant's
    # super-block of 256 may span several slices
    if small:
        lo, hi = min(ks), sorted(ks)[1]
        return [GemmConfig(16, 32, lo, 1, 4, 3, dot), GemmConfig(16, 64, hi, 2, 4, 3, dot),
                GemmConfig(32, 32, lo, 1, 4, 3, dot)]
    decode = [GemmConfig(16, bn, bk, sk, 4, 3, dot) for sk in (1, 2, 4) for bk in ks for bn in (64, 32, 128)]
    batch = [GemmConfig(bm, bn, ks[0], 1, w, s, dot)
             for bm in (32, 64, 128) for bn in (64, 128) for w in (4, 8) for s in (3, 4)]
    return decode + batch


RunFn = Callable[[torch.Tensor, torch.Tensor, Format, int, GemmConfig], torch.Tensor]
TimeFn = Callable[[Callable[[], Any], GemmConfig, int], float]


def timer(device: str | torch.device, runs: int | None = None, warmup: int | None = None,
          flush_bytes: int = 256 << 20) -> TimeFn:
    """time_fn(call, config, m) -> median microseconds of `runs` calls after `warmup`: CUDA
    events with a buffer written before each (so W is read from memory, as in serving, not L2);
    on CPU perf_counter (one run under the interpreter: its times are meaningless as speed)."""
    cuda = torch.device(device).type == "cuda"
    runs = runs or (25 if cuda else 1)
    warmup = warmup if warmup is not None else (3 if cuda else 0)
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if cuda else None

    def time_us(call: Callable[[], Any], config: GemmConfig, m: int) -> float:
        for _ in range(warmup):
            call()
        if not cuda:
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            flush.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
    return time_us


def quantized_weight(fmt, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random N(0, 1) [N, K] matrix quantized by the format's quantizer -> raw rows on CPU (the
    K-quants, which gguf cannot quantize: random codes and scales, `bench_cases.random_blocks`)."""
    f = format_of(fmt)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if f.name == "nvfp4":
        return quantize_nvfp4_torch(w).contiguous()
    if f.block == 256:
        from .bench_cases import random_blocks

        return random_blocks(f.name, n, k, torch.Generator().manual_seed(seed), "cpu").contiguous()
    import gguf  # numpy quantizers, bit for bit llama.cpp's

    raw = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, f.name.upper()))
    return torch.from_numpy(raw).contiguous()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf for a shape mismatch or a non-finite value)."""
    if got.shape != want.shape:
        return math.inf
    scale, err = want.abs().max().item(), (got.float() - want).abs().max().item()
    err = err / scale if scale > 0 else err
    return err if math.isfinite(err) else math.inf


_X_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Trial:
    """What one key's search shares: the weight, the activations, the hooks, the references."""
    fmt: Format
    k: int
    raw: torch.Tensor
    device: Any
    run_fn: RunFn
    time_fn: TimeFn
    m_max: int
    seed: int
    refs: dict = field(default_factory=dict)

    def x(self, m: int, dot: str) -> torch.Tensor:
        """The first m rows of one fixed random activation matrix, in the dot's input type
        (float32 under the interpreter, which computes in float32)."""
        if "x" not in self.refs:
            gen = torch.Generator().manual_seed(self.seed + 1)
            self.refs["x"] = torch.randn(self.m_max, self.k, generator=gen).to(self.device)
        dtype = torch.float32 if INTERPRET or torch.device(self.device).type != "cuda" else _X_DTYPE[dot]
        return self.refs["x"][:m].to(dtype)

    def ref(self, m: int, dot: str) -> torch.Tensor:
        if (m, dot) not in self.refs:
            self.refs[(m, dot)] = wgemm_torch(self.x(m, dot), self.raw, self.fmt, self.k)
        return self.refs[(m, dot)]

    def run(self, x: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
        return self.run_fn(x, self.raw, self.fmt, self.k, cfg)


def check(ctx: Trial, m: int, cfg: GemmConfig, rows) -> tuple[str | None, float]:
    """(why the candidate is dropped or None, its error against the reference)."""
    try:
        cfg.check(ctx.fmt)
        y = ctx.run(ctx.x(m, cfg.dot), cfg)
    except Exception as e:  # noqa: BLE001 - a config the device cannot run (shared memory, ...)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", math.inf
    err = rel_error(y, ctx.ref(m, cfg.dot))
    if err > TOLERANCE[cfg.dot]:
        return f"max_rel_err {err:.3g} over the {cfg.dot} bound {TOLERANCE[cfg.dot]}", err
    if rows is not None and not torch.equal(y[:rows[0]], rows[1]):
        return f"its first {rows[0]} rows differ from the decode winner's (not batch-invariant)", err
    return None, err
