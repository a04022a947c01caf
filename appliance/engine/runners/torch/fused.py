"""The forward's small ops on the kernels of `kernels/` (the torch runner with its Triton
kernels on): RMSNorm of the residual, the Q/K norm and RoPE in one pass, and decode attention
(spans of up to `model.DECODE_ROWS` rows) over the slot KV pool, split over keys.

Each replaces the torch code of `model` that computes the same thing, with the same contract
(float32 in, float32 out), and keeps the runner's exactness property: every kernel computes a
row from that row's inputs and position alone (kernels/ proves it per kernel; the runner's
start-up check proves it for the whole forward)."""
from __future__ import annotations

import math

import torch

from kernels import decode_attention, norm_rope


class Fused:
    def __init__(self, kind: str, rope_dim: int, n_head: int, head_dim: int, eps: float) -> None:
        self.kind, self.rope_dim, self.n_head, self.eps = kind, rope_dim, n_head, eps
        self.scale = 1.0 / math.sqrt(head_dim)
        # what every layer of one forward shares, made once: the rotation's cos/sin, and each
        # span's positions and slot indices
        self._rot: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._rows: tuple[tuple[int, int, int], torch.Tensor, torch.Tensor] | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm_rope.rms_norm(x, weight, eps)

    def qk(self, qk: torch.Tensor, rot: torch.Tensor, q_norm: torch.Tensor | None,
           k_norm: torch.Tensor | None) -> torch.Tensor:
        """qk [N, H + G, E] float32 (a view of the stacked projection) -> normed (qwen3) and
        rotated, a new tensor; rot is the model's [N, 1, E/2] complex rotation."""
        if self._rot is None or self._rot[0] is not rot:
            self._rot = (rot, rot.real[:, 0].contiguous(), rot.imag[:, 0].contiguous())
        _, cos, sin = self._rot
        return norm_rope.qk_norm_rope(qk, self.n_head, cos, sin, self.kind, self.rope_dim,
                                      q_norm, k_norm, self.eps)

    def attend_rows(self, q: torch.Tensor, start: int, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    layer: int, slot: int) -> torch.Tensor:
        """Rows at positions start.. of `slot`, q [T, H, E] -> [T, H * E] float32."""
        t = q.shape[0]
        if self._rows is None or self._rows[0] != (start, t, slot):
            self._rows = ((start, t, slot), torch.arange(start, start + t, device=q.device),
                          torch.full((t,), slot, dtype=torch.long, device=q.device))
        _, positions, slots = self._rows
        out = decode_attention.decode_attention(q.contiguous(), k_pool, v_pool, layer, slots, positions,
                                                self.scale)
        return out.reshape(t, -1)

    def attend_at(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                  slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One row each at tensor positions and slots, q [B, H, E] -> [B, H * E] float32, the
        grid sized from the pool (nothing read back: a CUDA graph can hold it)."""
        out = decode_attention.decode_attention(q.contiguous(), k_pool, v_pool, layer, slots, positions,
                                                self.scale, max_position=k_pool.shape[3] - 1)
        return out.reshape(q.shape[0], -1)
