"""The torch runner's KV pool: `n_slots` sequences of `n_ctx` positions, one K and one V tensor
for the whole pool, so truncate, copy_prefix, save and restore are slicing.

A slot's KV is valid for positions [0, length); writing at `start` requires start <= length
(a span continues the sequence or overwrites its tail, as after a truncate).

The saved form of a slot is self-describing, so a blob from another model or dtype is refused
rather than restored into the wrong shapes: magic, a little-endian u32 header length, a JSON
header (positions, layers, KV heads, head dim, dtype), then K's and V's bytes for [0, n).
"""
from __future__ import annotations

import json
import struct

import torch

from ....errors import EngineFailure

MAGIC = b"ATKV1\n"


class KVPool:
    def __init__(self, n_layer: int, n_slots: int, n_ctx: int, n_head_kv: int, head_dim: int,
                 dtype: torch.dtype, device, spare: int = 0) -> None:
        # `spare` slots past the n_slots: where a CUDA graph's padding rows write (never read)
        shape = (n_layer, n_slots + spare, n_head_kv, n_ctx, head_dim)
        # zeros, not empty: decode rows attend over whole key blocks, masked past their position,
        # and a masked position must hold a finite number (0 * NaN is NaN). llama.cpp clears its
        # buffer too.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_ctx, self.length = n_ctx, [0] * n_slots
        # each (layer, slot)'s [G, n_ctx, E] views, made once: a step indexes them 60 times
        self._at = [[(self.k[i, s], self.v[i, s]) for s in range(n_slots)] for i in range(n_layer)]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, G, E]) at positions start..; return the slot's [G, start + T, E] views."""
        end = start + k.shape[0]
        keys, values = self.claim(layer, slot, start, k.shape[0])
        keys[:, start:end] = k.transpose(0, 1)
        values[:, start:end] = v.transpose(0, 1)
        return keys[:, :end], values[:, :end]

    def claim(self, layer: int, slot: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's whole [G, n_ctx, E] K and V views, for a caller that stores n positions at
        start itself (`cpu_kernels`' attend_span), with `write`'s check and length keeping."""
        end = start + n
        if start > self.length[slot] or end > self.n_ctx:
            raise EngineFailure(f"KV write at positions [{start}, {end}) of slot {slot}, which "
                                f"holds {self.length[slot]} of {self.n_ctx}")
        if layer == len(self._at) - 1:
            self.length[slot] = end
        return self._at[layer][slot]

    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Store one position a row, k, v [B, G, E] at (slots[b], positions[b]): tensors, so a
        CUDA graph can hold the write. Lengths are the caller's (`graphs.DecodeGraphs`)."""
        self.k[layer][slots, :, positions] = k.to(self.k.dtype)
        self.v[layer][slots, :, positions] = v.to(self.v.dtype)

    def view(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, end) of the slot, [G, end, E] (past its length: stale or zero)."""
        keys, values = self._at[layer][slot]
        return keys[:, :end], values[:, :end]

    def truncate(self, slot: int, n_keep: int) -> None:
        self.length[slot] = min(self.length[slot], max(0, n_keep))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        n = min(n, self.length[src])
        if src != dst:
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.length[dst] = n

    def save(self, slot: int) -> bytes:
        n = self.length[slot]
        n_layer, _, g, _, e = self.k.shape
        header = json.dumps({"n": n, "layers": n_layer, "kv_heads": g, "head_dim": e,
                             "dtype": str(self.k.dtype)}).encode()
        parts = [MAGIC, struct.pack("<I", len(header)), header]
        for t in (self.k, self.v):
            parts.append(_bytes(t[:, slot, :, :n]))
        return b"".join(parts)

    def restore(self, slot: int, blob: bytes) -> None:
        n_layer, _, g, _, e = self.k.shape
        head = self._header(blob)
        want = {"layers": n_layer, "kv_heads": g, "head_dim": e, "dtype": str(self.k.dtype)}
        if any(head.get(k) != v for k, v in want.items()) or not 0 <= head.get("n", -1) <= self.n_ctx:
            raise EngineFailure(f"a saved KV state for {head} does not fit this pool ({want})")
        n = head["n"]
        offset = len(MAGIC) + 4 + struct.unpack_from("<I", blob, len(MAGIC))[0]
        size = n_layer * g * n * e * self.k.element_size()
        if len(blob) != offset + 2 * size:
            raise EngineFailure(f"a saved KV state is {len(blob)} bytes, expected {offset + 2 * size}")
        for t, at in ((self.k, offset), (self.v, offset + size)):
            raw = torch.frombuffer(bytearray(blob[at:at + size]), dtype=torch.uint8) if size else None
            if raw is not None:
                t[:, slot, :, :n] = raw.view(t.dtype).view(n_layer, g, n, e).to(t.device)
        self.length[slot] = n

    @staticmethod
    def _header(blob: bytes) -> dict:
        try:
            if not blob.startswith(MAGIC):
                raise ValueError("bad magic")
            (size,) = struct.unpack_from("<I", blob, len(MAGIC))
            return json.loads(blob[len(MAGIC) + 4:len(MAGIC) + 4 + size])
        except (ValueError, struct.error) as e:
            raise EngineFailure(f"not a saved torch KV state ({e})") from None


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
