"""What kernels/bench.py measures: each kernel at the shapes of a shape set ("full", "quick",
or "tiny" for the interpreter) as a Case that builds its inputs on the device and returns the
kernel's call and its torch reference's, with the bytes it must move at least (the napkin
math), its FLOPs for GEMMs, and the error bound of the dtype its products are taken in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import decode_attention as da
from . import moe_gemm as mg
from . import norm_rope as nr
from . import wgemm as wg
from ._triton import INTERPRET
from .formats import format_of

# max |error| / max |reference| allowed, by the dtype the kernel's products are taken in: bf16
# rounds a decoded weight to 8 bits (2^-9 relative), fp16 to 11; float32 differs by order alone
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Repeats:
    warmup: int
    kernel: int
    reference: int


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


ALL_FORMATS = ("q4_0", "q4_1", "q8_0", "mxfp4", "nvfp4", "q4_k", "q5_k", "q6_k")
BLOCK_32_FORMATS = ALL_FORMATS[:5]   # the interpreter's tiny K of 128 holds no K-quant super-block
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
    "tiny": Shapes(((32, 128),), (1, 20), BLOCK_32_FORMATS,
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
    if fmt in ("q4_k", "q5_k"):                           # d, dmin: six-bit scales and mins multiply them
        b[..., 0:2], b[..., 2:4] = f16(2 ** -12, 2 ** -10), f16(2 ** -12, 2 ** -10)
    if fmt == "q6_k":                                     # d: signed eight-bit scales multiply it
        b[..., 208:210] = f16(2 ** -14, 2 ** -12)
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
