"""Grouped weight-only GEMM for mixture-of-experts layers: every (row, expert) pair a layer's
router chose, multiplied by its expert's matrix in one launch, y[p] = x[row(p)] W[e(p)]^T.

Layout. The experts' matrices are stacked, W [X, N, ...]: either GGUF blocks as the file
stores them, uint8 [X, N, row_bytes] in one of `formats.FORMATS` (decoded in registers by
`wgemm`'s decoder), or dense [X, N, K] in float32/float16/bfloat16 (the expert cache's pool
of slots, `X` its slot count). The pairs come sorted by expert and padded per expert to whole
BLOCK_M tiles (`Routing`): `rows` int32 [T * BLOCK_M] gives the x row of each padded pair
(-1 for padding), `tiles` int32 [T] the stacked index of each tile's expert. A program owns
one BLOCK_M x BLOCK_N tile of y: it reads its expert's index once, gathers its rows of x,
and accumulates over K in BLOCK_K slices as `wgemm` does. y [T * BLOCK_M, N] float32 holds
the pairs in the padded order; `Routing.pairs` says where each real pair landed.

A SwiGLU expert layer is two calls: gate and up stacked along N (one call over the routed
rows of x), silu(gate) * up in torch, then down over those [P, F] rows in the same order
(`Routing.identity`). The router's weights and the sum over a row's k experts stay with the
caller (`appliance`'s expert code), which owns the order of that sum.

Exactness. A pair's result is computed from its own row of x and its expert's matrix only,
in an order fixed by BLOCK_K (no split-K here): whichever other pairs share its tile or the
launch, a token's expert output is the same bits, so a one-token step equals that row of a
verify (the runner's start-up check proves it on the device).

Under TRITON_INTERPRET=1 the operands are float32 and the dot is the products summed over K,
for the reason `wgemm` gives.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ._triton import INTERPRET, available, jit, tl, triton
from .formats import Format, dequantize_torch, format_of, row_bytes
from .wgemm import DEFAULT, INTERPRET_NUMEL, GemmConfig, _decode, _dot

DENSE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Routing:
    """Pairs sorted by expert and padded per expert to whole tiles of `block_m` pairs.

    rows   int32 [T * block_m]  the x row of each padded pair; -1 for padding
    tiles  int32 [T]            the stacked weight index (expert, or pool slot) of each tile
    pairs  int64 [P]            the padded position of each real pair, in the order given
    """

    rows: torch.Tensor
    tiles: torch.Tensor
    pairs: torch.Tensor
    block_m: int

    @property
    def padded(self) -> int:
        return self.rows.shape[0]

    def identity(self) -> "Routing":
        """The same tiles over rows already in padded order (the second matmul of an expert)."""
        rows = torch.where(self.rows >= 0, torch.arange(self.padded, device=self.rows.device, dtype=torch.int32), -1)
        return replace(self, rows=rows.to(torch.int32))


def route(rows: np.ndarray, counts: np.ndarray, index: np.ndarray, block_m: int, device) -> Routing:
    """rows [P]: the x row of each pair, grouped by expert in ascending expert order; counts [X]:
    each expert's pair count; index [X]: where expert e's matrix sits in the stack (its number,
    or its pool slot). Experts with no pairs get no tile."""
    rows, counts = np.asarray(rows, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    used = np.flatnonzero(counts)
    n_tiles = -(-counts[used] // block_m)                                    # tiles per used expert
    padded_start = np.concatenate(([0], np.cumsum(n_tiles * block_m)))[:-1]  # first padded pair
    start = np.concatenate(([0], np.cumsum(counts[used])))[:-1]             # first real pair
    # each real pair's padded position: its expert's padded start plus its rank in the expert
    rank = np.arange(len(rows)) - np.repeat(start, counts[used])
    pairs = np.repeat(padded_start, counts[used]) + rank
    padded_rows = np.full(int(n_tiles.sum()) * block_m, -1, dtype=np.int32)
    padded_rows[pairs] = rows
    tiles = np.repeat(np.asarray(index, dtype=np.int32)[used], n_tiles)
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)   # noqa: E731
    return Routing(t(padded_rows, torch.int32), t(tiles, torch.int32), t(pairs, torch.int64), block_m)


def moe_gemm_torch(x: torch.Tensor, w: torch.Tensor, routing: Routing, fmt: str | None = None,
                   k: int | None = None) -> torch.Tensor:
    """The reference: for each tile, its rows of x (zeros for padding) @ its expert's matrix^T,
    in float32 -> [T * block_m, N] float32. `fmt` None: w dense [X, N, K]; else blocks."""
    k = x.shape[1] if k is None else k
    bm = routing.block_m
    out = torch.zeros(routing.padded, w.shape[1], dtype=torch.float32, device=x.device)
    rows = routing.rows.long()
    for t, e in enumerate(routing.tiles.tolist()):
        r = rows[t * bm:(t + 1) * bm]
        xs = torch.where((r >= 0)[:, None], x[r.clamp(min=0)].float(), 0.0)
        we = w[e].float() if fmt is None else dequantize_torch(w[e], fmt, k)
        out[t * bm:(t + 1) * bm] = xs @ we.T
    return out


@jit
def _moe_gemm_kernel(x_ptr, w_ptr, y_ptr, rows_ptr, tiles_ptr, N, K, sxm, sxk, swe, swn, sym,
                     FMT: tl.constexpr, QB: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tiles_ptr + pid_m).to(tl.int64)                 # the tile's expert, an offset
    rp = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                # padded pair positions
    r = tl.load(rows_ptr + rp)                                  # their rows of x; -1: padding
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    we = w_ptr + e * swe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                    (r >= 0)[:, None] & (kk < K)[None, :], 0).to(tl.float32)
        if FMT < 0:   # dense [X, N, K], rows contiguous
            w = tl.load(we + rn[:, None].to(tl.int64) * swn + kk[None, :],
                        (rn < N)[:, None] & (kk < K)[None, :], 0).to(tl.float32)
        else:
            w = _decode(we, rn, kk, swn, N, K, FMT, QB, NB)
        acc = _dot(acc, x, w, DOT)
    out = y_ptr + rp[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(out, acc, (rn < N)[None, :])


def moe_gemm(x: torch.Tensor, w: torch.Tensor, routing: Routing, fmt: str | None = None,
             k: int | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] float32/float16/bfloat16; w the stacked experts, dense [X, N, K] (fmt None) or
    GGUF blocks uint8 [X, N, row_bytes] in `fmt`; routing from `route` with the config's
    block_m -> y [T * block_m, N] float32, the pairs in padded order."""
    cfg = config or DEFAULT
    k = x.shape[1] if k is None else k
    f = _check(x, w, routing, fmt, k, cfg)
    if not available(x.device):
        raise RuntimeError(f"no Triton launch on {x.device} here: use moe_gemm_torch")
    n = w.shape[1]
    y = torch.empty((routing.padded, n), dtype=torch.float32, device=x.device)
    if routing.padded == 0:
        return y
    launch = _interpreted(cfg) if INTERPRET else cfg
    dot = 3 if INTERPRET else (0 if cfg.dot == "fp32" else (1 if cfg.dot == "bf16" else 2))
    grid = (routing.tiles.shape[0], triton.cdiv(n, launch.block_n))
    _moe_gemm_kernel[grid](x, w, y, routing.rows, routing.tiles, n, k, x.stride(0), x.stride(1),
                           w.stride(0), w.stride(1), y.stride(0),
                           FMT=f.code if f is not None else -1, QB=f.block if f is not None else 1,
                           NB=f.nbytes if f is not None else 1, BLOCK_M=routing.block_m,
                           BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, DOT=dot,
                           num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y


def _check(x: torch.Tensor, w: torch.Tensor, routing: Routing, fmt: str | None, k: int,
           cfg: GemmConfig) -> Format | None:
    f = format_of(fmt) if fmt is not None else None
    if f is not None:
        cfg.check(f)
    if cfg.split_k != 1:
        raise ValueError("the grouped GEMM does not split K")
    if routing.block_m != cfg.block_m:
        raise ValueError(f"routing tiles of {routing.block_m} pairs, config block_m {cfg.block_m}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DENSE:
        raise ValueError(f"x must be [M, {k}] float32/float16/bfloat16; got {x.dtype} {list(x.shape)}")
    if f is None:
        ok = w.dim() == 3 and w.shape[2] == k and w.dtype in DENSE and w.stride(2) == 1
        want = f"dense [X, N, {k}] float32/float16/bfloat16, rows contiguous"
    else:
        ok = w.dim() == 3 and w.dtype == torch.uint8 and w.shape[2] == row_bytes(f, k) and w.stride(2) == 1
        want = f"{f.name} blocks uint8 [X, N, {row_bytes(f, k)}], rows contiguous"
    if not ok:
        raise ValueError(f"W must be {want}; got {w.dtype} {list(w.shape)} strides {w.stride()}")
    if x.device != w.device or routing.rows.device != x.device:
        raise ValueError(f"x, W and the routing must share a device ({x.device}, {w.device}, {routing.rows.device})")
    if routing.rows.dtype != torch.int32 or routing.tiles.dtype != torch.int32:
        raise ValueError("routing rows and tiles are int32")
    return f


def _interpreted(cfg: GemmConfig) -> GemmConfig:
    """Under the interpreter, block_n narrowed until a tile's [BLOCK_M, BLOCK_K, BLOCK_N]
    products fit its 2^20 elements (block_m is the routing's; a row's sums depend on block_k
    only, so the result is the config's, bit for bit)."""
    bn = cfg.block_n
    while cfg.block_m * bn * cfg.block_k > INTERPRET_NUMEL and bn > 16:
        bn //= 2
    return replace(cfg, block_n=bn)


def bytes_moved(pairs: int, experts: int, n: int, k: int, fmt: str | None, w_bytes: int = 2,
                x_bytes: int = 2) -> int:
    """What one call must read and write at least: each used expert's matrix once, each pair's
    row of x once, y once (float32)."""
    per = n * row_bytes(format_of(fmt), k) if fmt is not None else n * k * w_bytes
    return experts * per + pairs * k * x_bytes + pairs * n * 4


__all__ = ["DENSE", "Routing", "bytes_moved", "moe_gemm", "moe_gemm_torch", "route"]
