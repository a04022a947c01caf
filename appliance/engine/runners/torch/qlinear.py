"""GGUF weights kept quantized. On the CPU, Q4_0, Q4_1 and Q4_K matrices kept as 4-bit codes,
so a decode step reads a quarter of the bytes a bfloat16 copy would (`Int4Linear`), multiplied
by the CPU kernels' int4 matmul where they are built with AVX512-BF16 (`cpu_kernels`, in the
layout of `pack_tiles`), else by torch's int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`).
On a GPU, every block format `kernels.wgemm` reads, kept on the device as the file stores it
(`BlockLinear`).

Format mapping. A GGUF block is 32 consecutive weights of one row (along the input
dimension), 18 bytes for Q4_0 (f16 d, 16 bytes of nibbles) and 20 for Q4_1 (f16 d, f16 m,
nibbles); byte j holds element j in its low nibble and element j + 16 in its high nibble.
  Q4_0: w = d * (q - 8)          Q4_1: w = d * q + m
torch's kernel computes w = (q - 8) * scale + zero per group of `group` input elements, with
`scales_and_zeros` [K / group, N, 2]. So scale = d, and zero = 0 (Q4_0) or m + 8 d (Q4_1):
the same 4-bit codes, with the block's scale and offset rounded to the activation dtype
(bfloat16), which is the only change from the file. A Q8_0 matrix (the embedded model's tied
output, and every layer matrix of a Q8_0 file) goes through the same kernel as two int4 halves
of its codes (`split_q8_0`): the file's bytes (K bytes of codes a row, as Q8_0's), only the
scales rounded; the embeddings are then read from the file's blocks (`BlockEmbedding`).
Codes of 5 bits (Q5_0, Q5_1, Q5_K) and 6 bits (Q6_K, a scale per 16 weights) are the same
formula with the bits past the nibble in a second plane, read by the CPU kernels only
(`WIDE`); a stack of matrices in different forms (a Q4_K_M layer's Q4_K Q and K beside its
Q6_K V) is one `Int4Linear` per form (`StackedLinear`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

import gguf

from kernels.formats import FORMATS, dequantize_torch
from kernels.wgemm import DEFAULT as DEFAULT_GEMM, GemmConfig, wgemm

from .weights import QuantBlocks

GROUP = 32
SUPPORTED = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K)
Q8_0 = gguf.GGMLQuantizationType.Q8_0      # kept as two int4 halves (split_q8_0)
_Q = gguf.GGMLQuantizationType
# codes wider than 4 bits: the CPU kernels' int4 matmul only (a second plane of high bits), by
# type: (bits, weights per scale)
WIDE = {_Q.Q5_0: (5, 32), _Q.Q5_1: (5, 32), _Q.Q5_K: (5, 32), _Q.Q6_K: (6, 16)}
_BLOCK_BYTES = {_Q.Q4_0: 18, _Q.Q4_1: 20, _Q.Q5_0: 22, _Q.Q5_1: 24}


def form(qtype) -> tuple[int, int, bool]:
    """(code bits, weights per scale, input doubled) of a type kept quantized on the CPU."""
    if qtype == Q8_0:
        return 4, GROUP, True
    bits, group = WIDE.get(qtype, (4, GROUP))
    return bits, group, False


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def unpack(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K] uint8 (0..15, to 0..63 for `WIDE` types), scale and zero [N, K / group]
    float32, group being 32 or, for Q6_K, 16, such that w = (codes - 8) * scale + zero equals
    gguf's dequantization of the same blocks (to float32 rounding)."""
    if b.qtype == _Q.Q4_K:
        return unpack_q4_k(b)
    if b.qtype in (_Q.Q5_K, _Q.Q6_K):
        return (unpack_q5_k if b.qtype == _Q.Q5_K else unpack_q6_k)(b)
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n, k // GROUP, _BLOCK_BYTES[b.qtype])
    d = _f16(raw, 0)                                                               # [N, K/32]
    offset = 4 if b.qtype in (_Q.Q4_1, _Q.Q5_1) else 2
    high = np.zeros((n, k // GROUP, GROUP), np.uint8)
    if b.qtype in (_Q.Q5_0, _Q.Q5_1):   # 32 high bits, element j's at bit j of a little-endian word
        qh = raw[..., offset:offset + 4].copy().view("<u4")
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        offset += 4
    m = _f16(raw, 2) if b.qtype in (_Q.Q4_1, _Q.Q5_1) else None
    nib = raw[..., offset:]
    codes = (np.concatenate((nib & 0x0F, nib >> 4), axis=-1) | high).reshape(n, k)   # [N, K]
    centre = 16 if b.qtype in (_Q.Q5_0,) else 8     # Q5_0: w = d (q - 16); Q4_0: d (q - 8)
    zero = m + 8 * d if m is not None else (8 - centre) * d
    return codes, d, zero


def unpack_q4_k(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`unpack` for Q4_K: a super-block of 256 weights (144 bytes: f16 d and dmin, 12 bytes of
    six-bit scales and mins for its 8 sub-blocks of 32, 128 bytes of nibbles, each 32 bytes
    holding one sub-block in its low nibbles and the next in its high ones) is
    w = d sc_j q - dmin m_j per sub-block j, q in 0..15: 4-bit codes with group 32, scale d sc_j
    and zero 8 d sc_j - dmin m_j, as torch's and the CPU kernels' int4 matmuls take them.
    The six-bit fields are read by gguf's own `Q4_K.get_scale_min`."""
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n * (k // 256), 144)
    d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]                                 # [B, 1]
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])                                   # [B, 8] each
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, k)
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    return codes, scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP)


def unpack_q5_k(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`unpack` for Q5_K: Q4_K's super-block (176 bytes: d, dmin, the 12 bytes of scales and
    mins, then 32 bytes of high bits, then the 128 bytes of nibbles) with a fifth bit per weight:
    bit j of byte l of the high bits is weight l of sub-block j. w = d sc_j q - dmin m_j, q in
    0..31."""
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n * (k // 256), 176)
    d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])
    qh = raw[:, 16:48]                                                                      # [B, 32]
    qs = raw[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4       # [B, 8, 32]
    codes = ((qs & 0x0F).reshape(-1, 8, 32) | high).reshape(n, k)
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    return codes, scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP)


def unpack_q6_k(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`unpack` for Q6_K: a super-block of 256 weights (210 bytes: 128 bytes of low nibbles,
    64 of high bit pairs, 16 signed eight-bit scales, f16 d) is w = d sc_j (q - 32) per 16
    weights, q in 0..63. Each half of 128 weights reads 64 nibble bytes l (weights l and
    l + 32 in the low nibbles, l + 64 and l + 96 in the high ones) and 32 bytes of bit pairs
    (bits 0-1, 2-3, 4-5, 6-7 for those four). Group 16: scale d sc_j, zero -24 d sc_j."""
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n * (k // 256), 210)
    ql = raw[:, :128].reshape(-1, 2, 2, 32)                     # [B, half, l / 32, 32]
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32)                  # [B, half, 1, 32]
    low = np.stack((ql & 0x0F, ql >> 4), axis=2).reshape(-1, 2, 4, 32)    # quarters: l, l+32, l+64, l+96
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).reshape(n, k)
    scale = _f16(raw, 208)[:, None] * raw[:, 192:208].copy().view(np.int8).astype(np.float32)   # [B, 16]
    return codes, scale.reshape(n, k // 16), (-24 * scale).reshape(n, k // 16)


def split_q8_0(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0 matrix [N, K] as `unpack`'s (codes, scale, zero) of an int4 matrix [N, 2K] whose
    product with [x, x] is the original's with x: each code q = 16 h + l, h in -8..7 and l in
    0..15, so the first K columns are h with scale 16 d (codes h + 8, zero 0) and the last K
    are l with scale d (zero 8 d). The weights are then d q exactly, with only d rounded as
    Q4 scales are (a bfloat16 copy of d q would round each weight to 8 significant bits)."""
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n, k // GROUP, 34)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)          # [N, K/32]
    q = raw[..., 2:].copy().view(np.int8).reshape(n, k).astype(np.int16)
    codes = np.concatenate(((q >> 4) + 8, q & 0x0F), axis=1).astype(np.uint8)    # [N, 2K]
    scale = np.concatenate((16 * d, d), axis=1)
    zero = np.concatenate((np.zeros_like(d), 8 * d), axis=1)
    return codes, scale, zero


def pack_tiles(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype,
               bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`unpack`'s (codes, scale, zero) of an [N, K] matrix (N a multiple of 16) in the layout of
    the CPU kernels' int4 matmul (csrc/cpu_kernels.cpp): tiles of 16 rows; per group of 32
    inputs, pair p (inputs 2p, 2p + 1) of the 16 rows as 32 codes, (row n, input 2p + t) at
    2n + t, pairs 2j and 2j + 1 in the low and high nibbles of 32 bytes -> uint8 [N/16, K/32,
    256]; the groups' scales and zeros, [N/16, K/32, 2, 16] in `dtype` (scales per 16: [N/16,
    K/32, 4, 16], each half's scales then zeros); and for codes of `bits` > 4 the bits past
    the nibble, hb = bits - 4 a code: pair vector c (8 / hb) + i in bits [i hb, (i + 1) hb) of
    chunk c's 32 bytes -> uint8 [N/16, K/32, 64 hb] (else None)."""
    n, k = codes.shape
    g, t = k // GROUP, n // 16
    lanes = codes.reshape(t, 16, g, 16, 2).transpose(0, 2, 3, 1, 4).reshape(t, g, 16, 32)   # [T, G, pair, 2n + t]
    pairs = (lanes & 0x0F).reshape(t, g, 8, 2, 32)
    packed = (pairs[:, :, :, 0, :] | (pairs[:, :, :, 1, :] << 4)).astype(np.uint8).reshape(t, g, 256)
    high = None
    if bits > 4:
        hb = bits - 4
        per = 8 // hb
        chunks = (lanes >> 4).reshape(t, g, 2 * hb, per, 32).astype(np.uint8)
        shifts = (np.arange(per, dtype=np.uint8) * hb).reshape(1, 1, 1, per, 1)
        high = torch.from_numpy(np.ascontiguousarray(np.bitwise_or.reduce(chunks << shifts, axis=3).reshape(t, g, 64 * hb)))
    halves = scale.shape[1] // g          # 1, or 2 for scales per 16
    sz = np.stack((scale.reshape(t, 16, g, halves).transpose(0, 2, 3, 1),
                   zero.reshape(t, 16, g, halves).transpose(0, 2, 3, 1)), 3).reshape(t, g, 2 * halves, 16)
    return (torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(sz)).to(dtype), high)


class Int4Linear:
    """y = x W^T with W kept as 4-bit codes; x and y as in `model.Linear`. Several matrices with
    the same input (Q, K, V; gate and up) are stacked into one along the output. Packed for
    torch's int4 kernel (layout "torch") or for the CPU kernels' int4 matmul ("tiles",
    `pack_tiles`: about half torch's time on this machine, each output computed alone);
    `use` gives it the kernels' module, repacking if the layout was not theirs. The matrices
    share one `form`: Q5_x and Q6_K codes (5 and 6 bits) are read by the CPU kernels only;
    without them such a matrix is computed from a bfloat16 copy (layout "dense")."""

    def __init__(self, blocks: QuantBlocks | Sequence[QuantBlocks], dtype: torch.dtype,
                 bias: torch.Tensor | None = None, layout: str = "torch") -> None:
        self.blocks = [blocks] if isinstance(blocks, QuantBlocks) else list(blocks)   # the file's (mapped)
        forms = {form(b.qtype) for b in self.blocks}
        if len(forms) != 1:
            raise ValueError("an Int4Linear stacks matrices of one form (code bits, group, doubled input) only")
        self.bits, self.group, self.doubled = forms.pop()   # doubled: see split_q8_0, the input [x, x]
        self.dtype, self.bias, self.kernel, self.high, self.dense = dtype, bias, None, None, None
        self._pack(layout)

    def _parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = [split_q8_0(b) if self.doubled else unpack(b) for b in self.blocks]
        return tuple(np.concatenate(x) for x in zip(*parts))

    def _pack(self, layout: str) -> None:
        codes, scale, zero = self._parts()
        self.shape, self.high, self.dense = codes.shape, None, None
        self.layout = layout = "dense" if layout == "torch" and self.bits > 4 else layout
        if layout == "tiles":
            self.packed, self.scales_zeros, self.high = pack_tiles(codes, scale, zero, self.dtype, self.bits)
        elif layout == "dense":   # no kernel for wide codes: the weights the kernel would hold, bfloat16
            s, z = (torch.from_numpy(a).to(self.dtype).float().repeat_interleave(self.group, 1) for a in (scale, zero))
            self.dense = ((torch.from_numpy(codes).float() - 8) * s + z).to(self.dtype)
            self.packed = self.scales_zeros = None
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 2)
            sz = np.stack((scale, zero), axis=-1).transpose(1, 0, 2)                   # [K/32, N, 2]
            self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(self.dtype)

    def use(self, mod=None) -> None:
        """Multiply with `mod`'s int4_matmul (the CPU kernels' module), or torch's kernel (None)."""
        layout = "tiles" if mod is not None else ("dense" if self.bits > 4 else "torch")
        if layout != self.layout:
            self._pack(layout)
        self.kernel = mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.to(self.dtype)          # the model's activations are [N, K] already: no reshapes
        flat = flat if flat.dim() == 2 else flat.reshape(-1, x.shape[-1])
        flat = torch.cat((flat, flat), 1) if self.doubled else flat
        if self.kernel is not None and (self.bits > 4 or self.group != GROUP):
            y = self.kernel.quant_matmul(flat.contiguous(), self.packed, self.high, self.scales_zeros,
                                         self.bits - 4, self.group)
        elif self.kernel is not None:
            y = self.kernel.int4_matmul(flat.contiguous(), self.packed, self.scales_zeros)
        elif self.layout == "torch":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros).float()
        elif self.layout == "dense":
            y = torch.nn.functional.linear(flat, self.dense).float()
        else:
            raise RuntimeError("an int4 matrix packed in tiles needs the CPU kernels (Int4Linear.use)")
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])
        return y + self.bias if self.bias is not None else y


def summary(lins: Sequence[Int4Linear]) -> str:
    """How many matrices are kept in each form: "4-bit 16, 6-bit 14, 8-bit 15" ("none")."""
    counts: dict[int, int] = {}
    for lin in lins:
        bits = 8 if lin.doubled else lin.bits
        counts[bits] = counts.get(bits, 0) + 1
    return ", ".join(f"{b}-bit {n}" for b, n in sorted(counts.items())) or "none"


class StackedLinear:
    """Matrices with one input kept in different forms (a Q4_K_M layer's Q4_K Q and K beside its
    Q6_K V): each run of one form an `Int4Linear` (on a GPU a `BlockLinear`), their outputs
    side by side."""

    def __init__(self, parts: Sequence, n_in: int, bias: torch.Tensor | None) -> None:
        self.parts, self.bias = list(parts), bias          # Int4Linear or BlockLinear parts
        self.shape = (sum(p.shape[0] for p in parts), n_in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y + self.bias if self.bias is not None else y


GemmChoice = Callable[[str, int, int, int], GemmConfig]   # (format, N, K, M) -> config


def block_format(b: QuantBlocks) -> str | None:
    """The kernel format of a matrix's blocks, or None when `kernels.wgemm` cannot read them."""
    name = b.qtype.name.lower()
    return name if name in FORMATS and len(b.shape) == 2 and b.shape[1] % FORMATS[name].block == 0 else None


class BlockLinear:
    """y = x W^T with W as the file's blocks on the device, uint8 [N, row bytes], multiplied by
    `kernels.wgemm` with the config `choose` picks for each call's row count (the tuned plan's
    GEMM entries; a shape it lacks takes the default and is recorded as a miss). Matrices with
    the same input and format are stacked along the output, as in `model.Linear`."""

    def __init__(self, blocks: Sequence[QuantBlocks], device, bias: torch.Tensor | None = None,
                 choose: GemmChoice | None = None) -> None:
        fmts = {block_format(b) for b in blocks}
        if len(fmts) != 1 or None in fmts:
            raise ValueError(f"BlockLinear stacks matrices of one kernel format, not {sorted(map(str, fmts))}")
        self.fmt = fmts.pop()
        rows = [np.ascontiguousarray(b.data).reshape(b.shape[0], -1) for b in blocks]
        self.raw = torch.from_numpy(np.concatenate(rows)).to(device)
        self.shape = (self.raw.shape[0], blocks[0].shape[1])
        self.bias, self.choose = bias, choose or (lambda fmt, n, k, m: DEFAULT_GEMM)
        # tensor scales (ModelOpt NVFP4), one per stacked matrix: each output row's, applied once
        self.row_scale = (torch.cat([torch.full((b.shape[0],), 1.0 if b.scale is None else b.scale)
                                     for b in blocks]).to(device)
                          if any(b.scale is not None for b in blocks) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        rows = x.reshape(-1, k)
        y = wgemm(rows, self.raw, self.fmt, k, self.choose(self.fmt, n, k, rows.shape[0]))
        y = y if self.row_scale is None else y * self.row_scale
        y = y.view(*x.shape[:-1], n)
        return y + self.bias if self.bias is not None else y


def _layout(int4: bool | str) -> str:
    """The int4 layout `int4` names ("torch" or "tiles"; True is torch's)."""
    return int4 if isinstance(int4, str) else "torch"


def kept(blocks: Sequence[QuantBlocks], shapes: Sequence[tuple[int, int]], dtype: torch.dtype, device,
         bias: torch.Tensor | None, int4: bool | str, gemm: GemmChoice | None
         ) -> Int4Linear | StackedLinear | BlockLinear | None:
    """The matrices (stacked) kept quantized when a kernel reads them as stored, else None;
    `int4` a str: the int4 layout ("torch" or "tiles"; wide codes in "tiles" only)."""
    if any(b.shape != s for b, s in zip(blocks, shapes)):
        return None
    if int4:
        runs = _runs(blocks, _layout(int4))
        if runs is not None:
            if len(runs) == 1:
                return Int4Linear(runs[0], dtype, bias, layout=_layout(int4))
            return StackedLinear([Int4Linear(r, dtype, layout=_layout(int4)) for r in runs], shapes[0][1], bias)
    if gemm is None or any(block_format(b) is None for b in blocks):
        return None
    runs = _group(blocks, block_format)
    if len(runs) == 1:
        return BlockLinear(blocks, device, bias, gemm)
    return StackedLinear([BlockLinear(r, device, None, gemm) for r in runs], shapes[0][1], bias)


def _group(blocks: Sequence[QuantBlocks], key: Callable) -> list[list[QuantBlocks]]:
    """Consecutive matrices with the same `key` together."""
    runs: list[list[QuantBlocks]] = []
    for b in blocks:
        if runs and key(runs[-1][0]) == key(b):
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _runs(blocks: Sequence[QuantBlocks], layout: str) -> list[list[QuantBlocks]] | None:
    """The matrices in runs of one form, each of N in 16s (torch packs so, and the kernels'
    tiles are 16 rows), or None when one of them cannot be kept in `layout`."""
    ok = SUPPORTED + (Q8_0,) + (tuple(WIDE) if layout == "tiles" else ())
    if any(b.qtype not in ok for b in blocks):
        return None
    runs = _group(blocks, lambda b: form(b.qtype))
    return runs if all(sum(b.shape[0] for b in r) % 16 == 0 for r in runs) else None


class BlockEmbedding:
    """Token embeddings looked up in the file's blocks: `embed[tokens]` decodes just those rows
    to float32 (`kernels.formats.dequantize_torch`, or gguf's own dequantization for a type the
    kernels do not read: gguf's values bit for bit either way), so no table of the whole
    vocabulary is held once the output matrix needs none."""

    def __init__(self, b: QuantBlocks, device) -> None:
        self.fmt, self.k, self.scale, self.qtype = block_format(b), b.shape[1], b.scale, b.qtype
        self.raw = torch.from_numpy(np.array(b.data).reshape(b.shape[0], -1)).to(device)   # a copy: the map is read-only

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.fmt is None:
            rows = self.raw[tokens]
            flat = gguf.quants.dequantize(rows.cpu().numpy(), self.qtype).reshape(-1, self.k)
            return torch.from_numpy(flat).to(rows.device).reshape(*tokens.shape, self.k)
        rows = dequantize_torch(self.raw[tokens], self.fmt, self.k)
        return rows if self.scale is None else rows * self.scale


def output_and_embedding(output: QuantBlocks, embed: QuantBlocks, shape: tuple[int, int], dtype: torch.dtype,
                         device, int4: bool | str, table: Callable[[], torch.Tensor]):
    """The output matrix [V, D] kept quantized when `int4` and `kept` would keep it (Q4_0, Q4_1,
    Q4_K, Q8_0 as `split_q8_0`; Q5_x and Q6_K in the kernels' layout), and then the embeddings
    looked up in the file's blocks (`BlockEmbedding`) where they are quantized; else None for
    the output and the embedding `table()` (the caller's dequantized copy, which a tied output
    shares). Int4 matrices are packed with N in multiples of 16 only."""
    fits = output.shape == shape and embed.shape == shape and shape[0] % 16 == 0 and shape[1] % GROUP == 0
    runs = _runs([output], _layout(int4)) if int4 and fits else None
    kept_out = Int4Linear(output, dtype, layout=_layout(int4)) if runs is not None else None
    quantized = embed.qtype not in (_Q.F32, _Q.F16, _Q.BF16) and embed.scale is None or block_format(embed) is not None
    if kept_out is not None and quantized:
        return kept_out, BlockEmbedding(embed, device)
    return kept_out, table()
