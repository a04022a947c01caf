"""Routed experts on the grouped kernel (`kernels.moe_gemm`): the torch runner's MoE path with
its Triton kernels on. One launch computes gate and up of every (row, expert) pair a layer's
router chose, one launch down, and each row's k expert outputs are then weighted and summed
in the router's order (`combine`).

Weights (`ExpertMats`, X experts or pool slots, D model width, F expert width):

    gate_up  [X, 2F, D] dense in the compute dtype, or [X, 2F, row bytes of D] GGUF blocks
    down     [X, D, F] dense, or [X, D, row bytes of F] blocks

Blocks as the file stores them where gate, up and down are all in one kernel format (a
quarter of the bytes for 4-bit experts, decoded in registers), else dense; the expert cache's
pool of slots is dense and takes the same calls with slot numbers for expert numbers.

Exactness: a pair's output depends on its own row and expert only (the kernel's property),
and `combine` adds a row's k weighted outputs one choice at a time, in the router's order,
never with atomics, so a row is the same bits whatever else the forward holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels import INTERPRET
from kernels.formats import FORMATS
from kernels.moe_gemm import moe_gemm, route
from kernels.wgemm import GemmConfig

# one config for every call (a row's sums depend on block_k only): tiles of 16 pairs suit
# decode, where an expert gets a few rows; under the interpreter wide N tiles save programs
CONFIG = GemmConfig(block_m=16, block_n=256 if INTERPRET else 64, block_k=128)


@dataclass(frozen=True)
class ExpertMats:
    gate_up: torch.Tensor
    down: torch.Tensor
    fmt: str | None          # the blocks' kernel format; None: dense
    dim: int
    ff: int
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # gpt-oss: gate, up [X, F], down [X, D]

    @classmethod
    def dense(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, biases=None) -> "ExpertMats":
        return cls(torch.cat((gate, up), 1), down, None, gate.shape[2], gate.shape[1], biases)


def block_mats(gate, up, down, dim: int, ff: int, device, biases=None) -> ExpertMats | None:
    """gate, up, down as `weights.QuantBlocks` [X, F, D], [X, F, D], [X, D, F] kept as their
    blocks when all three share a kernel format, else None (`biases`: gpt-oss's)."""
    names = {b.qtype.name.lower() for b in (gate, up, down)}
    fmt = names.pop() if len(names) == 1 and all(b.scale is None for b in (gate, up, down)) else None
    if fmt not in FORMATS or dim % FORMATS[fmt].block or ff % FORMATS[fmt].block:
        return None
    x = gate.shape[0]

    def raw(b, rows: int) -> torch.Tensor:
        return torch.from_numpy(np.array(b.data).reshape(x, rows, -1))   # a copy: the map is read-only
    gate_up = torch.cat((raw(gate, ff), raw(up, ff)), 1).to(device)
    return ExpertMats(gate_up, raw(down, dim).to(device), fmt, dim, ff, biases)


def host_groups(chosen: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """chosen [N, k] on the host -> (rows, which, counts) as `experts.group_by_expert` gives
    them: the pairs sorted by expert (stable), and each expert's pair count."""
    k = chosen.shape[1]
    order = np.argsort(chosen.ravel(), kind="stable")
    return order // k, order % k, np.bincount(chosen.ravel(), minlength=n_expert)


def pair_outputs(x: torch.Tensor, mats: ExpertMats, rows: np.ndarray, counts: np.ndarray,
                 index: np.ndarray) -> torch.Tensor:
    """The SwiGLU output of each pair: x [N, D] float32; rows [P] the x row of each pair, grouped
    by expert in ascending order, counts [X] per expert, index [X] where each expert's matrices
    sit in `mats` -> [P, D] float32 in the pairs' order."""
    r = route(rows, counts, index, CONFIG.block_m, x.device)
    h = moe_gemm(x, mats.gate_up, r, mats.fmt, mats.dim, CONFIG)                   # [T*16, 2F]
    if mats.biases is None:
        a = F.silu(h[:, :mats.ff]) * h[:, mats.ff:]
        return moe_gemm(a, mats.down, r.identity(), mats.fmt, mats.ff, CONFIG)[r.pairs]   # [P, D]
    e = r.tiles.long().repeat_interleave(r.block_m)      # gpt-oss: each padded pair's expert, for its biases
    a = oai_glu(h[:, :mats.ff] + mats.biases[0][e], h[:, mats.ff:] + mats.biases[1][e])
    return (moe_gemm(a, mats.down, r.identity(), mats.fmt, mats.ff, CONFIG) + mats.biases[2][e])[r.pairs]


def oai_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate, llama.cpp's ggml_swiglu_oai (alpha 1.702, limit 7), float32: g = min(g, 7),
    u = clamp(u, -7, 7) -> g sigmoid(1.702 g) (u + 1)."""
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return g * torch.sigmoid(1.702 * g) * (u + 1.0)


def combine(y: torch.Tensor, rows: np.ndarray, which: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
    """Pair outputs y [P, D] (pair i is choice which[i] of row rows[i]) weighted by the router's
    weights [N, k] and summed per row, choice by choice -> [N, D] float32."""
    n, k = weights.shape
    r = torch.from_numpy(rows).to(y.device)
    c = torch.from_numpy(which).to(y.device)
    per = y.new_zeros(n, k, y.shape[1])
    per[r, c] = y * weights[r, c, None]
    out = per[:, 0]
    for j in range(1, k):
        out = out + per[:, j]
    return out


class GroupedExperts:
    """A layer's routed experts, all resident, on the grouped kernel (`model.MoE`'s path with
    the kernels on)."""

    def __init__(self, mats: ExpertMats, n_expert: int) -> None:
        self.mats, self.n_expert = mats, n_expert
        self.index = np.arange(n_expert)

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows, which, counts = host_groups(chosen.cpu().numpy(), self.n_expert)   # one transfer
        return combine(pair_outputs(x, self.mats, rows, counts, self.index), rows, which, weights)
