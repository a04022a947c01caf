"""RMSNorm of the residual, and the per-head RMSNorm + RoPE of Q and K, as the torch runner's
model does them (`rms_norm`, `Rope`, `Attention.__call__`), each fused into one pass.

RMSNorm, x [N, C] (rows may be strided, values in a row contiguous) -> y [N, C] float32:
one program per row holds the whole row (C rounded up to a power of two, masked), sums x^2 in
float32, and writes x * rsqrt(mean(x^2) + eps) * weight. torch reads x twice (pow/mean, then
the products) and writes three temporaries; here x is read once and y written once.

Q and K, qk [N, H + G, E] (a view of the stacked QKV projection: rows and heads strided, the E
values of a head contiguous) -> a float32 tensor of the same shape (new, or `out`, which may be
qk itself: a program reads all of its heads before writing them). One program per
(row, block of heads). A head's values are taken as three parts, each loaded once:
  a, b  the rotated pairs: "norm" pairs (x_2i, x_2i+1), "neox" pairs (x_i, x_i+rope_dim/2);
  tail  the values past rope_dim, passed through.
With q_norm/k_norm (qwen3), the head's sum of squares is the sum over the three parts, and each
part is scaled by the rsqrt and by the weight of its head's kind (query heads are the first H).
Then the pair (a, b) at position p becomes (a cos - b sin, a sin + b cos) with the angle
p * inv_freq[i] -- the model's complex multiply, written out. The cos/sin tables come from
`rope_tables`, built the way the model builds its rotation (angles in float64), so that the
kernel, the reference and the model rotate by the same float32 numbers. torch needs a norm,
a cat, a complex multiply and another cat (four passes over qk); this is one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import available, jit, tl, triton

KINDS = ("norm", "neox")
MAX_C = 1 << 16        # a row lives in one block's registers: past this it would spill badly
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NormConfig:
    """RMSNorm launch. num_warps None: by row width, 4 up to 2K values, 8 to 8K, 16 past."""
    num_warps: int | None = None


@dataclass(frozen=True)
class RopeConfig:
    """Q/K norm + RoPE launch: block_heads heads of one row a program (a power of two). A head is
    only E = 64..256 values; 8 heads of 128 make a 1K-value tile, right for 4 warps."""
    block_heads: int = 8
    num_warps: int = 4


def _launchable(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if not available(dev):
        raise RuntimeError(f"no Triton kernel for {dev} tensors here (needs Triton, and a CUDA "
                           "device, or TRITON_INTERPRET=1 with CPU tensors): use the *_torch reference")


# ---------------------------------------------------------------------------------- RMSNorm

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's rms_norm, on x of any float dtype taken as float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, y_row_stride, C, eps,
                     BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)      # int64: N * stride can pass 2^31
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C                          # C need not be a power of two
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * y_row_stride + cols, x * r * w, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             config: NormConfig | None = None) -> torch.Tensor:
    """x [N, C] float32/float16/bfloat16, rows strided or not; weight [C] float32 -> a new
    [N, C] float32 tensor (the runner's residual stream stays float32)."""
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x: want [N, C] float32/16 or bfloat16, values in a row contiguous; "
                         f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    n, c = x.shape
    if weight.shape != (c,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"weight: want [{c}] float32 contiguous, got {tuple(weight.shape)} {weight.dtype}")
    if not 0 < c <= MAX_C:
        raise ValueError(f"C = {c}: one row a block, 1..{MAX_C} values")
    _launchable(x, weight)
    y = torch.empty(n, c, dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    block = triton.next_power_of_2(c)
    warps = (config or NormConfig()).num_warps or (4 if block <= 2048 else 8 if block <= 8192 else 16)
    _rms_norm_kernel[(n,)](x, weight, y, x.stride(0), y.stride(0), c, float(eps),
                           BLOCK_C=block, num_warps=warps)
    return y


# ------------------------------------------------------------------------------ Q/K + RoPE

def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                magnitude: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] (integers), inv_freq [rope_dim/2] (the model's Rope.inv_freq, float64, any
    linear or YaRN scaling in it) -> (cos, sin), each [N, rope_dim/2] float32 and scaled by
    `magnitude` (YaRN's attention factor, the model's Rope.magnitude): angles in float64, as
    `Rope.tables` takes them."""
    if positions.dim() != 1 or inv_freq.dim() != 1:
        raise ValueError(f"positions [N], inv_freq [rope_dim/2]: got {tuple(positions.shape)}, {tuple(inv_freq.shape)}")
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return (magnitude * torch.cos(angles)).float(), (magnitude * torch.sin(angles)).float()


def _check_qk(qk, n_q_heads, cos, sin, kind, rope_dim, q_norm, k_norm) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: want one of {KINDS}")
    if qk.dim() != 3 or qk.dtype not in _DTYPES or (qk.shape[2] > 1 and qk.stride(2) != 1):
        raise ValueError(f"qk: want [N, H + G, E] float32/16 or bfloat16, a head's values contiguous; "
                         f"got {tuple(qk.shape)} {qk.dtype} strides {qk.stride()}")
    n, heads, e = qk.shape
    if not 0 < n_q_heads < heads:
        raise ValueError(f"n_q_heads = {n_q_heads}: want 1..{heads - 1} (then at least one K head)")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > e:
        raise ValueError(f"rope_dim = {rope_dim}: want even, 2..E (= {e})")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, rope_dim // 2) or t.dtype != torch.float32 or t.stride() != cos.stride() \
                or (rope_dim > 2 and t.stride(1) != 1):
            raise ValueError(f"{name}: want [{n}, {rope_dim // 2}] float32 (rope_tables), "
                             f"got {tuple(t.shape)} {t.dtype} strides {t.stride()} (cos {cos.stride()})")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: both or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (e,) or w.dtype != torch.float32 or not w.is_contiguous()):
            raise ValueError(f"{name}: want [{e}] float32 contiguous, got {tuple(w.shape)} {w.dtype}")


def qk_norm_rope_torch(qk: torch.Tensor, n_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                       kind: str, rope_dim: int, q_norm: torch.Tensor | None = None,
                       k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """What Attention.__call__ does to qk before attention: the optional per-head RMSNorm
    (q_norm over the first n_q_heads heads, k_norm over the rest), then Rope. New float32 tensor."""
    _check_qk(qk, n_q_heads, cos, sin, kind, rope_dim, q_norm, k_norm)
    x, h, half = qk.float(), n_q_heads, rope_dim // 2
    if q_norm is not None:
        x = torch.cat((rms_norm_torch(x[:, :h], q_norm, eps), rms_norm_torch(x[:, h:], k_norm, eps)), 1)
    part = x[..., :rope_dim]
    a, b = (part[..., 0::2], part[..., 1::2]) if kind == "norm" else (part[..., :half], part[..., half:])
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, a * s + b * c            # (a + ib)(c + is), as the model multiplies
    out = torch.stack((ra, rb), -1).flatten(-2) if kind == "norm" else torch.cat((ra, rb), -1)
    return torch.cat((out, x[..., rope_dim:]), -1)


@jit
def _qk_norm_rope_kernel(qk_ptr, out_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                         qk_row_stride, qk_head_stride, out_row_stride, out_head_stride,
                         cs_row_stride, n_heads, n_q_heads, E, HALF, eps,
                         NEOX: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)              # [BH] heads
    hm = (h < n_heads)[:, None]
    i = tl.arange(0, BLOCK_R)                                            # [BR] pair index
    im = i < HALF
    if NEOX:
        ia = i
        ib = i + HALF
    else:
        ia = 2 * i
        ib = 2 * i + 1
    t = 2 * HALF + tl.arange(0, BLOCK_T)                                 # [BT] passed through
    tm = t < E
    src = qk_ptr + row * qk_row_stride + h[:, None].to(tl.int64) * qk_head_stride
    a = tl.load(src + ia[None, :], mask=hm & im[None, :], other=0.0).to(tl.float32)
    b = tl.load(src + ib[None, :], mask=hm & im[None, :], other=0.0).to(tl.float32)
    x = tl.load(src + t[None, :], mask=hm & tm[None, :], other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(x * x, axis=1)
        r = (1.0 / tl.sqrt(ss / E + eps))[:, None]
        is_k = (h >= n_q_heads)[:, None]          # each head its kind's weight: load both, pick
        a = a * r * tl.where(is_k, tl.load(kn_ptr + ia, mask=im)[None, :], tl.load(qn_ptr + ia, mask=im)[None, :])
        b = b * r * tl.where(is_k, tl.load(kn_ptr + ib, mask=im)[None, :], tl.load(qn_ptr + ib, mask=im)[None, :])
        x = x * r * tl.where(is_k, tl.load(kn_ptr + t, mask=tm)[None, :], tl.load(qn_ptr + t, mask=tm)[None, :])
    c = tl.load(cos_ptr + row * cs_row_stride + i, mask=im, other=0.0)[None, :]
    s = tl.load(sin_ptr + row * cs_row_stride + i, mask=im, other=0.0)[None, :]
    dst = out_ptr + row * out_row_stride + h[:, None].to(tl.int64) * out_head_stride
    tl.store(dst + ia[None, :], a * c - b * s, mask=hm & im[None, :])
    tl.store(dst + ib[None, :], a * s + b * c, mask=hm & im[None, :])
    tl.store(dst + t[None, :], x, mask=hm & tm[None, :])


def qk_norm_rope(qk: torch.Tensor, n_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 kind: str, rope_dim: int, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                 config: RopeConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """qk_norm_rope_torch in one kernel. Writes `out` ([N, H + G, E] float32, a head's values
    contiguous; qk itself is allowed when qk is float32) or, without it, a new tensor."""
    _check_qk(qk, n_q_heads, cos, sin, kind, rope_dim, q_norm, k_norm)
    cfg = config or RopeConfig()
    if cfg.block_heads < 1 or cfg.block_heads & (cfg.block_heads - 1):
        raise ValueError(f"block_heads = {cfg.block_heads}: want a power of two")
    n, heads, e = qk.shape
    if out is None:
        out = torch.empty(n, heads, e, dtype=torch.float32, device=qk.device)
    elif out.shape != qk.shape or out.dtype != torch.float32 or (e > 1 and out.stride(2) != 1):
        raise ValueError(f"out: want {tuple(qk.shape)} float32, a head's values contiguous")
    norm = q_norm is not None
    _launchable(qk, cos, sin, out, *((q_norm, k_norm) if norm else ()))
    if n == 0:
        return out
    half = rope_dim // 2
    qn, kn = (q_norm, k_norm) if norm else (cos, cos)    # unread without NORM: any pointer
    grid = (n, triton.cdiv(heads, cfg.block_heads))
    _qk_norm_rope_kernel[grid](
        qk, out, cos, sin, qn, kn, qk.stride(0), qk.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), heads, n_q_heads, e, half, float(eps),
        NEOX=kind == "neox", NORM=norm, BLOCK_H=cfg.block_heads,
        BLOCK_R=triton.next_power_of_2(half), BLOCK_T=triton.next_power_of_2(max(e - rope_dim, 1)),
        num_warps=cfg.num_warps)
    return out
