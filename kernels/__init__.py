"""Kernels for the torch runner's GPU path, each beside the plain-torch reference it is checked
against (llm.c's `dev/cuda` and the Triton tutorials are the models).

One module a kernel family. Each has: a docstring that lays out the data before the code, the
`@triton.jit` kernel(s), a host wrapper that checks shapes, dtypes and strides and launches
with an explicit config (never `@triton.autotune`: configs come from the tuned plan), and a
`*_torch` reference written from the format's spec. On a machine without a GPU the reference
is the path; the Triton kernels run there only under `TRITON_INTERPRET=1` (tests).

- `formats`: GGUF Q4_0 / Q4_1 / Q8_0, NVFP4 (GGUF's layout and ModelOpt's) and MXFP4 blocks
  decoded in torch, bit for bit as `gguf.quants.dequantize` decodes them.
- `wgemm`: weight-only GEMM/GEMV over those blocks as the file stores them (y = x W^T),
  decoding each block in registers.
- `norm_rope`: fused RMSNorm, and RoPE applied to Q and K in one pass.
- `decode_attention`: decode attention over the runner's slot KV pool, split over keys.
- `plan`: the GEMM configurations `appliance tune` measured, keyed by shape and batch bucket.
- `bench`: each kernel timed against the device's memory-bandwidth limit.

This package imports nothing from `appliance` (the arrow points `appliance -> kernels`).
"""
from ._triton import INTERPRET, available, triton, tl

__all__ = ["INTERPRET", "available", "triton", "tl"]
