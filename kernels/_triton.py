"""Triton, when it is installed. `available(device)` says whether a kernel can run on tensors
of that device: compiled on a GPU, or interpreted (`TRITON_INTERPRET=1`, set before Triton is
first imported) on CPU tensors. Without Triton the references are the only path."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch does not bring Triton
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str = "cuda") -> bool:
    if triton is None:
        return False
    kind = torch.device(device).type
    if INTERPRET:
        return kind == "cpu"
    return kind == "cuda" and torch.cuda.is_available()


def jit(fn):
    """`triton.jit` when Triton is there; else the plain function (never launched)."""
    return triton.jit(fn) if triton is not None else fn
