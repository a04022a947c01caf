"""Weight-only GEMM over GGUF blocks as the file stores them: y = x W^T, x [M, K] in 16 or 32
bits, W [N, K] in one of `formats.FORMATS`, y [M, N] float32. Decode (M of 1-16) and prefill
shapes take the same kernel with other tile sizes.

Layout. W stays as its raw rows: uint8 [N, K / B * nbytes] (`formats` has each block's bytes).
A program owns a BLOCK_M x BLOCK_N tile of y. For each BLOCK_K slice of K it loads the x tile,
decodes the W tile in registers straight from the bytes (each element finds its block, its
scale and its nibble; nothing dequantized is ever written to memory), and accumulates one
`tl.dot` in float32. Scales are decoded arithmetically, exactly: f16 from its two bytes by
bitcast, E8M0 and UE4M3 by building the float32's bits. BLOCK_K is a multiple of the format's
block, or divides the K-quants' super-blocks of 256 (each element decodes from its own
block's bytes either way); K past the matrix is masked to zero.

With `split_k` > 1 the K loop is cut into that many contiguous ranges, each program writes its
partial tile, and the partials are summed in a fixed order: deterministic, for decode shapes
where N / BLOCK_N programs are too few to fill the GPU.

Exactness. A row of y is computed from its own row of x only, in an order fixed by BLOCK_K and
split_k; the tuned plan keeps those two fixed per (format, N, K) across batch buckets, so a
one-token step and a verify row agree (the runner's start-up check proves it on the device).

Under TRITON_INTERPRET=1 the operands are float32 (bfloat16 does not work in the interpreter)
and the dot is the products summed over K, not `tl.dot`: the interpreter's `tl.dot` is numpy's
matmul, and OpenBLAS's sgemm on an AMD Zen 5 host computes a row of a tile differently by
where the row sits in it (measured: a 7-row call's last row is 4e-7 off the same row alone),
which would fail the runner's exactness check for a reason no GPU has. On a GPU
`GemmConfig.dot` picks the operand type.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._triton import INTERPRET, available, jit, tl, triton
from .formats import FORMATS, Format, dequantize_torch, format_of, row_bytes

DOT_TYPES = ("bf16", "fp16", "fp32")
INTERPRET_NUMEL = 1 << 20   # the interpreter's largest tensor


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: str = "bf16"

    def check(self, fmt: Format) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two of at least 16, not {v}")
        if self.block_k % fmt.block and not (fmt.block == 256 and 256 % self.block_k == 0):
            raise ValueError(f"block_k {self.block_k} must hold whole {fmt.name} blocks of {fmt.block}"
                             + (" or divide one" if fmt.block == 256 else ""))
        if self.split_k < 1 or self.dot not in DOT_TYPES:
            raise ValueError(f"split_k >= 1 and dot in {DOT_TYPES}; got {self.split_k}, {self.dot!r}")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


DEFAULT = GemmConfig()


def wgemm_torch(x: torch.Tensor, raw: torch.Tensor, fmt, k: int) -> torch.Tensor:
    """The reference: x [M, K] @ dequantize(raw)^T in float32 -> [M, N] float32."""
    return x.float() @ dequantize_torch(raw, fmt, k).T


@jit
def _f16(lo, hi):
    return (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _e2m1_doubled(q):
    """4-bit E2M1 codes -> values doubled: {0, 1, 2, 3, 4, 6, 8, 12} with bit 3 the sign."""
    c = (q & 7).to(tl.int32)
    big = (2 + (c & 1)) << ((c >> 1) - 1)
    mag = tl.where(c < 4, c, big).to(tl.float32)
    return tl.where((q & 8) != 0, -mag, mag)


@jit
def _decode_k(w_ptr, base, i, valid, FMT: tl.constexpr):
    """`_decode` of the K-quants' super-blocks of 256 (formats.py has their layouts)."""
    if FMT == 5 or FMT == 6:   # q4_k / q5_k: sub-block j of 32, six-bit scale and min
        j = i // 32
        d = _f16(tl.load(w_ptr + base, valid, 0), tl.load(w_ptr + base + 1, valid, 0))
        dmin = _f16(tl.load(w_ptr + base + 2, valid, 0), tl.load(w_ptr + base + 3, valid, 0))
        s_j = tl.load(w_ptr + base + 4 + j, valid, 0)
        s_j4 = tl.load(w_ptr + base + 8 + j % 8, valid, 0)     # scales[j + 4] (j < 8 always)
        s_jm4 = tl.load(w_ptr + base + 4 + j % 4, valid, 0)    # scales[j - 4] where j >= 4
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4)).to(tl.float32)
        m = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4)).to(tl.float32)
        qs = 48 if FMT == 6 else 16
        b = tl.load(w_ptr + base + qs + 32 * (j // 2) + i % 32, valid, 0)
        q = (b >> (4 * (j % 2)).to(tl.uint8)) & 15
        if FMT == 6:
            h = tl.load(w_ptr + base + 16 + i % 32, valid, 0)
            q = q | (((h >> j.to(tl.uint8)) & 1) << 4)
        w = (d * sc) * q.to(tl.float32) - dmin * m
    else:           # q6_k: half h of 128, quarter c of 32; a signed scale per 16
        h, r = i // 128, i % 128
        c, l = r // 32, r % 32
        lo = tl.load(w_ptr + base + 64 * h + l + 32 * (c % 2), valid, 0)
        hi = tl.load(w_ptr + base + 128 + 32 * h + l, valid, 0)
        q = ((lo >> (4 * (c // 2)).to(tl.uint8)) & 15) | (((hi >> (2 * c).to(tl.uint8)) & 3) << 4)
        sc = tl.load(w_ptr + base + 192 + i // 16, valid, 0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(tl.load(w_ptr + base + 208, valid, 0), tl.load(w_ptr + base + 209, valid, 0))
        w = (d * sc) * (q.to(tl.float32) - 32)
    return w


@jit
def _decode(w_ptr, rn, kk, swn, N, K, FMT: tl.constexpr, QB: tl.constexpr, NB: tl.constexpr):
    """The W tile [BLOCK_N, BLOCK_K] in float32, decoded from its blocks' bytes."""
    valid = (rn < N)[:, None] & (kk < K)[None, :]
    base = rn[:, None].to(tl.int64) * swn + (kk // QB)[None, :] * NB
    i = (kk % QB)[None, :]
    if FMT == 0:    # q4_0: f16 d, 16 bytes of nibbles
        d = _f16(tl.load(w_ptr + base, valid, 0), tl.load(w_ptr + base + 1, valid, 0))
        b = tl.load(w_ptr + base + 2 + i % 16, valid, 0)
        w = d * (((b >> (4 * (i // 16)).to(tl.uint8)) & 15).to(tl.float32) - 8)
    elif FMT == 1:  # q4_1: f16 d, f16 m, 16 bytes of nibbles
        d = _f16(tl.load(w_ptr + base, valid, 0), tl.load(w_ptr + base + 1, valid, 0))
        m = _f16(tl.load(w_ptr + base + 2, valid, 0), tl.load(w_ptr + base + 3, valid, 0))
        b = tl.load(w_ptr + base + 4 + i % 16, valid, 0)
        w = d * ((b >> (4 * (i // 16)).to(tl.uint8)) & 15).to(tl.float32) + m
    elif FMT == 2:  # q8_0: f16 d, 32 int8
        d = _f16(tl.load(w_ptr + base, valid, 0), tl.load(w_ptr + base + 1, valid, 0))
        q = tl.load(w_ptr + base + 2 + i, valid, 0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d
    elif FMT == 3:  # mxfp4: E8M0 e, 16 bytes of nibbles; 2^(e - 128) built as float32 bits
        e = tl.load(w_ptr + base, valid, 0).to(tl.uint32)
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        d = bits.to(tl.float32, bitcast=True)
        b = tl.load(w_ptr + base + 1 + i % 16, valid, 0)
        w = d * _e2m1_doubled((b >> (4 * (i // 16)).to(tl.uint8)) & 15)
    elif FMT >= 5:  # the K-quants
        w = _decode_k(w_ptr, base, i, valid, FMT)
    else:           # nvfp4: 4 UE4M3 scales, then 8 bytes per 16-value sub-block
        sub, j = i // 16, i % 16
        s = tl.load(w_ptr + base + sub, valid, 0).to(tl.uint32)
        exp, man = (s >> 3) & 15, s & 7
        normal = ((exp + 119) << 23 | (man << 20)).to(tl.float32, bitcast=True)   # 2^(exp-8)(1+man/8)
        d = tl.where(exp == 0, man.to(tl.float32) * 0.0009765625, normal)          # man 2^-10
        d = tl.where(s == 0x7F, 0.0, d)
        b = tl.load(w_ptr + base + 4 + sub * 8 + j % 8, valid, 0)
        w = d * _e2m1_doubled((b >> (4 * (j // 8)).to(tl.uint8)) & 15)
    return w


@jit
def _dot(acc, x, w, DOT: tl.constexpr):
    """acc [M, N] + x [M, K] @ w [N, K]^T, the products in DOT's type (0 fp32, 1 bf16, 2 fp16;
    3, the interpreter: products summed over K, in one order for every row)."""
    if DOT == 3:
        acc += tl.sum(x[:, :, None] * tl.trans(w)[None, :, :], axis=1)
    elif DOT == 0:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    elif DOT == 1:
        acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    return acc


@jit
def _wgemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, sys_, sym, k_per,
                  FMT: tl.constexpr, QB: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                    (rm < M)[:, None] & (kk < k_hi)[None, :], 0).to(tl.float32)
        w = _decode(w_ptr, rn, kk, swn, N, k_hi, FMT, QB, NB)
        acc = _dot(acc, x, w, DOT)
    out = y_ptr + pid_s.to(tl.int64) * sys_ + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(out, acc, (rm < M)[:, None] & (rn < N)[None, :])


def wgemm(x: torch.Tensor, raw: torch.Tensor, fmt, k: int, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] float32/float16/bfloat16 @ W^T, W the [N, K] matrix in `fmt` as raw rows uint8
    [N, row_bytes] (each row contiguous) -> y [M, N] float32."""
    fmt, cfg = format_of(fmt), config or DEFAULT
    cfg.check(fmt)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be [M, {k}] float32/float16/bfloat16; got {x.dtype} {list(x.shape)}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(fmt, k) or raw.stride(1) != 1:
        raise ValueError(f"W must be uint8 rows [N, {row_bytes(fmt, k)}], each contiguous; "
                         f"got {raw.dtype} {list(raw.shape)} strides {raw.stride()}")
    if x.device != raw.device:
        raise ValueError(f"x is on {x.device}, W on {raw.device}")
    if not available(x.device):
        raise RuntimeError(f"no Triton launch on {x.device} here: use wgemm_torch")
    m, n = x.shape[0], raw.shape[0]
    if INTERPRET:
        cfg = _interpreted(cfg)
    # split ranges hold whole BLOCK_K slices, so a block never straddles two programs
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per)
    y = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    dot = 3 if INTERPRET else (0 if cfg.dot == "fp32" else (1 if cfg.dot == "bf16" else 2))
    _wgemm_kernel[grid](x, raw, y, m, n, k, x.stride(0), x.stride(1), raw.stride(0), y.stride(0),
                        y.stride(1), k_per, FMT=fmt.code, QB=fmt.block, NB=fmt.nbytes,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=dot,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y[0] if splits == 1 else y.sum(0)


def _interpreted(cfg: GemmConfig) -> GemmConfig:
    """The config launched under the interpreter: the tile narrowed until its [BLOCK_M, BLOCK_K,
    BLOCK_N] products fit the interpreter's 2^20 elements. A row's sums there depend on
    block_k and split_k only, so the result is the config's, bit for bit."""
    bm, bn = cfg.block_m, cfg.block_n
    while bm * bn * cfg.block_k > INTERPRET_NUMEL and max(bm, bn) > 16:
        bm, bn = (bm // 2, bn) if bm > bn else (bm, bn // 2)
    return replace(cfg, block_m=bm, block_n=bn)


def bytes_moved(m: int, n: int, k: int, fmt, x_bytes: int = 2) -> int:
    """What one call must read and write at least: W once, x once, y once (float32)."""
    return n * row_bytes(format_of(fmt), k) + m * k * x_bytes + m * n * 4


__all__ = ["DEFAULT", "DOT_TYPES", "FORMATS", "GemmConfig", "bytes_moved", "wgemm", "wgemm_torch"]
