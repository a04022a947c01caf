"""Decode attention over the torch runner's slot KV pool, split over keys (flash-decoding).

Data. The pool holds K and V as two tensors of shape [n_layer, n_slots, G, n_ctx, E] (G KV
heads, E head dim) in float32, float16 or bfloat16; strides (s_layer, s_slot, s_head, s_pos,
s_e) are passed to the kernel as they are, so a strided view of the pool needs no copy (the
layer is applied on the host, as a view). The queries are q [R, H, E] float32: R rows, each
from its own slot `slots[r]` at its own position `positions[r]`; query head h reads KV head
h // (H // G). Row r attends keys [0, positions[r]] of its slot; scores are scaled by
`scale` (1/sqrt(E) in the runner) and everything past the load is float32.

Programs. Pass one runs a grid (R, G, S): one program per row, KV head and key split. Split s
covers keys [s * split_keys, (s + 1) * split_keys), cut at the row's position, so where the
splits fall depends on the row's position alone, never on R or on the other rows; a program
whose split starts past its row's position exits at once (S comes from the largest position
in the call). A program takes all H // G query heads of its KV head together, as the rows of
a [BLOCK_H, E] tile (padded to a power of two, at least 16, for tl.dot), so each K and V block
is read once for the group. It walks its split in blocks of BLOCK_N keys with an online
softmax (base 2: the scale is folded with log2(e) into q) and writes a partial per query
head: the running max m, the sum l of exp2(score - m) and the unnormalised acc = sum p * v.

Pass two runs a grid (R, H) and merges a row's splits 0 .. positions[r] // split_keys in
ascending order, in float32, into out = acc / l.

Exactness. A row's arithmetic is fixed by its q, its slot's keys, its position and the config:
the same blocks, the same split boundaries, the same reduction order, no atomics. So a row
gives the same bits launched alone or with others, which the runner's "verify rows equal
single steps" check relies on. The dots use input_precision="ieee" (no TF32), so the kernel
agrees with the float32 reference to rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import available, jit, tl, triton

__all__ = ["DecodeAttentionConfig", "decode_attention", "decode_attention_torch"]

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeAttentionConfig:
    block_n: int = 64        # keys a loop step; a power of two, >= 16 (tl.dot's minimum)
    split_keys: int = 256    # keys a program; a multiple of block_n
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, not {self.block_n}")
        if self.split_keys <= 0 or self.split_keys % self.block_n:
            raise ValueError(f"split_keys ({self.split_keys}) must be a positive multiple of "
                             f"block_n ({self.block_n})")


def decode_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                           slots: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The definition, a row at a time: softmax(q k^T * scale) v over keys [0, p], in float32."""
    r_rows, n_head, _ = q.shape
    per = n_head // k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(r_rows):
        slot, p = int(slots[r]), int(positions[r])
        k = k_pool[layer, slot, :, :p + 1].float().repeat_interleave(per, 0)   # [H, p + 1, E]
        v = v_pool[layer, slot, :, :p + 1].float().repeat_interleave(per, 0)
        scores = torch.einsum("he,hle->hl", q[r].float(), k) * scale
        out[r] = torch.einsum("hl,hle->he", torch.softmax(scores, dim=-1), v)
    return out


@jit
def _split_kernel(Q, K, V, Slots, Pos, M, L, Acc, qk_scale,
                  sq_r, sq_h, sq_e, sk_s, sk_g, sk_n, sk_e, sv_s, sv_g, sv_n, sv_e,
                  n_head, n_split,
                  PER: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    row, kvh, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # the grid's axes
    pos = tl.load(Pos + row).to(tl.int32)
    lo = split * SPLIT_KEYS
    if lo > pos:  # the call's longest row needs this split, this row does not
        return
    hi = tl.minimum(lo + SPLIT_KEYS, pos + 1)

    offs_h = tl.arange(0, BLOCK_H)
    offs_e = tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * PER + offs_h
    h_ok = offs_h < PER
    e_ok = offs_e < HEAD_DIM
    q = tl.load(Q + row * sq_r + head[:, None] * sq_h + offs_e[None, :] * sq_e,
                mask=h_ok[:, None] & e_ok[None, :], other=0.0)
    q = q * qk_scale  # padded heads and dims are 0: finite scores, never stored

    slot = tl.load(Slots + row)  # int64: slot * stride may pass 2**31
    k_base = K + slot * sk_s + kvh * sk_g
    v_base = V + slot * sv_s + kvh * sv_g
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_E], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < hi  # masked keys are never read: stale or NaN pool entries cannot leak in
        kt = tl.load(k_base + n[None, :] * sk_n + offs_e[:, None] * sk_e,
                     mask=n_ok[None, :] & e_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee")                        # [BLOCK_H, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a key <= pos
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * sv_n + offs_e[None, :] * sv_e,
                    mask=n_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    part = (row * n_head + head) * n_split + split                      # [BLOCK_H]
    tl.store(M + part, m_i, mask=h_ok)
    tl.store(L + part, l_i, mask=h_ok)
    tl.store(Acc + part[:, None] * HEAD_DIM + offs_e[None, :], acc,
             mask=h_ok[:, None] & e_ok[None, :])


@jit
def _reduce_kernel(M, L, Acc, Pos, Out, so_r, so_h, so_e, n_head, n_split,
                   HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < HEAD_DIM
    n_used = tl.load(Pos + row).to(tl.int32) // SPLIT_KEYS + 1  # this row's splits only
    base = (row * n_head + head) * n_split
    m = tl.load(M + base)
    l = tl.load(L + base)
    acc = tl.load(Acc + base * HEAD_DIM + offs_e, mask=e_ok, other=0.0)
    for s in range(1, n_used):  # ascending, one at a time: a fixed order, whatever the call
        m_s = tl.load(M + base + s)
        l_s = tl.load(L + base + s)
        a_s = tl.load(Acc + (base + s) * HEAD_DIM + offs_e, mask=e_ok, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        acc = acc * alpha + a_s * beta
        m = m_new
    tl.store(Out + row * so_r + head * so_h + offs_e * so_e, acc / l, mask=e_ok)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                     slots: torch.Tensor, positions: torch.Tensor, scale: float,
                     config: DecodeAttentionConfig | None = None, max_position: int | None = None) -> torch.Tensor:
    """`decode_attention_torch`'s result from the two Triton kernels. q [R, H, E] float32, pools
    [n_layer, n_slots, G, n_ctx, E], slots and positions [R] int64; returns [R, H, E] float32.
    Reads the positions' and slots' range on the host once (one sync), to check them and size
    the grid; with `max_position` (a bound the caller keeps, n_ctx - 1 in a CUDA graph) the
    grid is sized from it and nothing is read back, so the call can be captured. Splits past a
    row's position exit at once, so a row's bits do not depend on the grid's size."""
    cfg = config or DecodeAttentionConfig()
    n_split = _check(q, k_pool, v_pool, layer, slots, positions, cfg, max_position)
    r_rows, n_head, e = q.shape
    g = k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if r_rows == 0:
        return out
    if not available(q.device):
        raise RuntimeError(f"decode_attention cannot launch on {q.device}: Triton is "
                           f"{'missing' if triton is None else 'not usable there'}; "
                           "use decode_attention_torch")
    per = n_head // g
    block_e = max(16, triton.next_power_of_2(e))
    m = torch.empty(r_rows, n_head, n_split, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(r_rows, n_head, n_split, e, dtype=torch.float32, device=q.device)
    k, v = k_pool[layer], v_pool[layer]  # views: the layer's offset applied here, in int64
    _split_kernel[(r_rows, g, n_split)](
        q, k, v, slots, positions, m, l, acc, float(scale) * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), n_head, n_split,
        PER=per, HEAD_DIM=e, BLOCK_H=max(16, triton.next_power_of_2(per)), BLOCK_E=block_e,
        BLOCK_N=cfg.block_n, SPLIT_KEYS=cfg.split_keys,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _reduce_kernel[(r_rows, n_head)](
        m, l, acc, positions, out, *out.stride(), n_head, n_split,
        HEAD_DIM=e, BLOCK_E=block_e, SPLIT_KEYS=cfg.split_keys, num_warps=1)
    return out


def _check(q, k_pool, v_pool, layer, slots, positions, cfg, max_position=None) -> int:
    """Raise ValueError on a bad call; return the number of splits the grid needs."""
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be [R, H, E] float32, not {tuple(q.shape)} {q.dtype}")
    if k_pool.dim() != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(f"pools must be [n_layer, n_slots, G, n_ctx, E], the same shape: "
                         f"k {tuple(k_pool.shape)}, v {tuple(v_pool.shape)}")
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"pools must share one dtype of {KV_DTYPES}: k {k_pool.dtype}, v {v_pool.dtype}")
    n_layer, n_slots, g, n_ctx, e = k_pool.shape
    r_rows, n_head, qe = q.shape
    if qe != e or g == 0 or n_head % g:
        raise ValueError(f"q {tuple(q.shape)} does not fit {g} KV heads of dim {e} "
                         "(E must match, H must be a multiple of G)")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.shape != (r_rows,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be [{r_rows}] int64, not {tuple(t.shape)} {t.dtype}")
    devices = {t.device for t in (q, k_pool, v_pool, slots, positions)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, not {sorted(map(str, devices))}")
    if not 0 <= layer < n_layer:
        raise ValueError(f"layer {layer} out of range [0, {n_layer})")
    if r_rows == 0:
        return 0
    if max_position is not None:
        if not 0 <= max_position < n_ctx:
            raise ValueError(f"max_position {max_position} outside [0, {n_ctx})")
        return math.ceil((max_position + 1) / cfg.split_keys)
    (s_lo, p_lo), (s_hi, p_hi) = torch.stack(torch.stack((slots, positions), 1).aminmax(dim=0)).tolist()
    if s_lo < 0 or s_hi >= n_slots:
        raise ValueError(f"slots span [{s_lo}, {s_hi}], outside [0, {n_slots})")
    if p_lo < 0 or p_hi >= n_ctx:
        raise ValueError(f"positions span [{p_lo}, {p_hi}], outside [0, {n_ctx})")
    return math.ceil((p_hi + 1) / cfg.split_keys)
