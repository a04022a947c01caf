"""GGUF weights kept quantized. On the CPU, Q4_0 and Q4_1 matrices kept as 4-bit codes, so a
decode step reads a quarter of the bytes a bfloat16 copy would (`Int4Linear`), multiplied by
the CPU kernels' int4 matmul where they are built with AVX512-BF16 (`cpu_kernels`, in the
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
_BLOCK_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def unpack(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K] uint8 in 0..15, scale [N, K/32] float32, zero [N, K/32] float32, such that
    w = (codes - 8) * scale + zero equals gguf's dequantization of the same blocks."""
    if b.qtype == gguf.GGMLQuantizationType.Q4_K:
        return unpack_q4_k(b)
    n, k = b.shape
    raw = np.ascontiguousarray(b.data).reshape(n, k // GROUP, _BLOCK_BYTES[b.qtype])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)          # [N, K/32]
    if b.qtype == gguf.GGMLQuantizationType.Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero, nib = m + 8 * d, raw[..., 4:]
    else:
        zero, nib = np.zeros_like(d), raw[..., 2:]
    codes = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(n, k)          # [N, K]
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
    d = raw[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)[:, None]              # [B, 1]
    dmin = raw[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)[:, None]
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])                                   # [B, 8] each
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, k)
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    return codes, scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP)


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


def pack_tiles(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`unpack`'s (codes, scale, zero) of an [N, K] matrix (N a multiple of 16) in the layout of
    the CPU kernels' int4 matmul (csrc/cpu_kernels.cpp): tiles of 16 rows; per group of 32
    inputs, pair p (inputs 2p, 2p + 1) of the 16 rows as 32 codes, (row n, input 2p + t) at
    2n + t, pairs 2j and 2j + 1 in the low and high nibbles of 32 bytes -> uint8 [N/16, K/32,
    256]; and the groups' scales and zeros, [N/16, K/32, 2, 16] in `dtype`."""
    n, k = codes.shape
    g, t = k // GROUP, n // 16
    pairs = codes.reshape(t, 16, g, 16, 2).transpose(0, 2, 3, 1, 4).reshape(t, g, 8, 2, 32)   # [T, G, j, lo/hi, 2n + t]
    packed = (pairs[:, :, :, 0, :] | (pairs[:, :, :, 1, :] << 4)).astype(np.uint8).reshape(t, g, 256)
    sz = np.stack((scale.reshape(t, 16, g).transpose(0, 2, 1), zero.reshape(t, 16, g).transpose(0, 2, 1)), 2)
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(sz)).to(dtype)


class Int4Linear:
    """y = x W^T with W kept as 4-bit codes; x and y as in `model.Linear`. Several matrices with
    the same input (Q, K, V; gate and up) are stacked into one along the output. Packed for
    torch's int4 kernel (layout "torch") or for the CPU kernels' int4 matmul ("tiles",
    `pack_tiles`: about half torch's time on this machine, each output computed alone);
    `use` gives it the kernels' module, repacking if the layout was not theirs."""

    def __init__(self, blocks: QuantBlocks | Sequence[QuantBlocks], dtype: torch.dtype,
                 bias: torch.Tensor | None = None, layout: str = "torch") -> None:
        self.blocks = [blocks] if isinstance(blocks, QuantBlocks) else list(blocks)   # the file's (mapped)
        self.doubled = self.blocks[0].qtype == Q8_0   # see split_q8_0: the input doubled, [x, x]
        if any((b.qtype == Q8_0) != self.doubled for b in self.blocks):
            raise ValueError("Q8_0 matrices stack with Q8_0 matrices only (their input is doubled)")
        self.dtype, self.bias, self.kernel = dtype, bias, None
        self._pack(layout)

    def _pack(self, layout: str) -> None:
        parts = [split_q8_0(b) if self.doubled else unpack(b) for b in self.blocks]
        codes, scale, zero = (np.concatenate(x) for x in zip(*parts))
        self.shape, self.layout = codes.shape, layout
        if layout == "tiles":
            self.packed, self.scales_zeros = pack_tiles(codes, scale, zero, self.dtype)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 2)
            sz = np.stack((scale, zero), axis=-1).transpose(1, 0, 2)                   # [K/32, N, 2]
            self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(self.dtype)

    def use(self, mod=None) -> None:
        """Multiply with `mod`'s int4_matmul (the CPU kernels' module), or torch's kernel (None)."""
        layout = "tiles" if mod is not None else "torch"
        if layout != self.layout:
            self._pack(layout)
        self.kernel = mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.to(self.dtype)          # the model's activations are [N, K] already: no reshapes
        flat = flat if flat.dim() == 2 else flat.reshape(-1, x.shape[-1])
        flat = torch.cat((flat, flat), 1) if self.doubled else flat
        if self.kernel is not None:
            y = self.kernel.int4_matmul(flat.contiguous(), self.packed, self.scales_zeros)
        elif self.layout == "torch":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros).float()
        else:
            raise RuntimeError("an int4 matrix packed in tiles needs the CPU kernels (Int4Linear.use)")
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])
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
         bias: torch.Tensor | None, int4: bool | str, gemm: GemmChoice | None) -> Int4Linear | BlockLinear | None:
    """The matrices (stacked) kept quantized when a kernel reads them as stored, else None;
    `int4` a str: the int4 layout ("torch" or "tiles")."""
    if any(b.shape != s for b, s in zip(blocks, shapes)):
        return None
    same = all(b.qtype in SUPPORTED for b in blocks) or all(b.qtype == Q8_0 for b in blocks)
    if int4 and same and sum(n for n, _ in shapes) % 16 == 0:   # torch packs N in 16s
        return Int4Linear(blocks, dtype, bias, layout=_layout(int4))
    fmts = {block_format(b) for b in blocks}
    if gemm is not None and len(fmts) == 1 and None not in fmts:
        return BlockLinear(blocks, device, bias, gemm)
    return None


class BlockEmbedding:
    """Token embeddings looked up in the file's blocks: `embed[tokens]` decodes just those rows
    to float32 (`kernels.formats.dequantize_torch`, gguf's values bit for bit), so no table of
    the whole vocabulary is held once the output matrix needs none."""

    def __init__(self, b: QuantBlocks, device) -> None:
        self.fmt, self.k, self.scale = block_format(b), b.shape[1], b.scale
        self.raw = torch.from_numpy(np.array(b.data).reshape(b.shape[0], -1)).to(device)   # a copy: the map is read-only

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = dequantize_torch(self.raw[tokens], self.fmt, self.k)
        return rows if self.scale is None else rows * self.scale


def output_and_embedding(output: QuantBlocks, embed: QuantBlocks, shape: tuple[int, int], dtype: torch.dtype,
                         device, int4: bool | str, table: Callable[[], torch.Tensor]):
    """The output matrix [V, D] kept as int4 when `int4` and it is Q4_0, Q4_1 or Q8_0
    (`split_q8_0`), and then the embeddings looked up in the file's blocks (`BlockEmbedding`)
    where their format allows; else None for the output and the embedding `table()` (the
    caller's dequantized copy, which a tied output shares). torch packs int4 matrices of N in
    multiples of 16 only."""
    fits = output.shape == shape and embed.shape == shape and shape[0] % 16 == 0 and shape[1] % GROUP == 0
    kept_out = (Int4Linear(output, dtype, layout=_layout(int4)) if int4 and fits and (
        output.qtype == Q8_0 or output.qtype in SUPPORTED) else None)
    if kept_out is not None and block_format(embed) is not None:
        return kept_out, BlockEmbedding(embed, device)
    return kept_out, table()
