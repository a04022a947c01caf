"""GGUF weights kept quantized. On the CPU, Q4_0 and Q4_1 matrices multiplied by torch's int4
weight-only kernel (`_weight_int4pack_mm_for_cpu`), so a decode step reads a quarter of the
bytes a bfloat16 copy would (`Int4Linear`). On a GPU, every block format `kernels.wgemm`
reads, kept on the device as the file stores it (`BlockLinear`).

Format mapping. A GGUF block is 32 consecutive weights of one row (along the input
dimension), 18 bytes for Q4_0 (f16 d, 16 bytes of nibbles) and 20 for Q4_1 (f16 d, f16 m,
nibbles); byte j holds element j in its low nibble and element j + 16 in its high nibble.
  Q4_0: w = d * (q - 8)          Q4_1: w = d * q + m
torch's kernel computes w = (q - 8) * scale + zero per group of `group` input elements, with
`scales_and_zeros` [K / group, N, 2]. So scale = d, and zero = 0 (Q4_0) or m + 8 d (Q4_1):
the same 4-bit codes, with the block's scale and offset rounded to the activation dtype
(bfloat16), which is the only change from the file.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

import gguf

from kernels.formats import FORMATS
from kernels.wgemm import DEFAULT as DEFAULT_GEMM, GemmConfig, wgemm

from .weights import QuantBlocks

GROUP = 32
SUPPORTED = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
_BLOCK_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def unpack(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K] uint8 in 0..15, scale [N, K/32] float32, zero [N, K/32] float32, such that
    w = (codes - 8) * scale + zero equals gguf's dequantization of the same blocks."""
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


class Int4Linear:
    """y = x W^T with W in torch's packed int4 layout; x and y as in `model.Linear`. Several
    matrices with the same input (Q, K, V; gate and up) are stacked into one along the output."""

    def __init__(self, blocks: QuantBlocks | Sequence[QuantBlocks], dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        parts = [unpack(b) for b in ([blocks] if isinstance(blocks, QuantBlocks) else blocks)]
        codes, scale, zero = (np.concatenate(x) for x in zip(*parts))
        n, k = codes.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes.astype(np.int32)), 2)
        sz = np.stack((scale, zero), axis=-1).transpose(1, 0, 2)                   # [K/32, N, 2]
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(dtype)
        self.dtype, self.bias, self.shape = dtype, bias, (n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.dtype).reshape(-1, self.shape[1]), self.packed, GROUP, self.scales_zeros)
        y = y.float().view(*x.shape[:-1], self.shape[0])
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        rows = x.reshape(-1, k)
        y = wgemm(rows, self.raw, self.fmt, k, self.choose(self.fmt, n, k, rows.shape[0]))
        y = y.view(*x.shape[:-1], n)
        return y + self.bias if self.bias is not None else y


def kept(blocks: Sequence[QuantBlocks], shapes: Sequence[tuple[int, int]], dtype: torch.dtype, device,
         bias: torch.Tensor | None, int4: bool, gemm: GemmChoice | None) -> Int4Linear | BlockLinear | None:
    """The matrices (stacked) kept quantized when a kernel reads them as stored, else None."""
    if any(b.shape != s for b, s in zip(blocks, shapes)):
        return None
    if int4 and all(b.qtype in SUPPORTED for b in blocks):
        return Int4Linear(blocks, dtype, bias)
    fmts = {block_format(b) for b in blocks}
    if gemm is not None and len(fmts) == 1 and None not in fmts:
        return BlockLinear(blocks, device, bias, gemm)
    return None
