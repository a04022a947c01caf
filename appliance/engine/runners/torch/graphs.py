"""Decode steps as CUDA graphs (`--torch-graphs`): the torch runner on a GPU with its kernels
spends most of a decode step launching a few hundred small kernels from Python; a graph
replays them in one call.

A step of B rows, one token each (B the number of sequences decoding together), runs padded to
a bucket of 1, 2, 4, 8, ... rows up to the slot count, each bucket captured once at start by
`capture()`:

    static inputs  tokens, positions, slots [bucket] int64 on the device, filled before replay
    the step       `model.Transformer.step`: the forward with positions and slots as tensors,
                   KV written by index (`KVPool.write_rows`), decode attention's grid sized from
                   n_ctx (nothing read back to the host, no shape taken from a position)
    static output  logits [bucket, V]; row b is row b of the step

Padding rows (a step of 3 in the bucket of 4) read token 0 at position 0 of the pool's spare
slot, which no sequence owns, and their logits are dropped. A row's result depends on its own
token, position and slot alone (every kernel is row-independent), so a graph's rows are the
same bits as `forward` gives them, which the start-up exactness check compares on the loaded
model (steps through the graphs, verify rows through `forward`).

Only dense models: a MoE layer routes on the host. `eager` runs the same fixed-shape step
without capture (a check that works on a CPU, under Triton's interpreter); a GPU where capture
fails serves with `forward` and says why in the runner's settings.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from .kv import KVPool

log = logging.getLogger("appliance.torch")
MODES = ("auto", "eager", "off")


def buckets(n_slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two holding n_slots rows."""
    out = [1]
    while out[-1] < n_slots:
        out.append(out[-1] * 2)
    return tuple(out)


class _Bucket:
    def __init__(self, rows: int, device) -> None:
        self.rows = rows
        self.inputs = torch.zeros((3, rows), dtype=torch.int64, device=device)   # tokens, positions, slots
        self.host = torch.zeros((3, rows), dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The buckets of one model and KV pool; `__call__` runs a step of one token a row."""

    def __init__(self, model, kv: KVPool, n_slots: int, device, capture: bool) -> None:
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.spare = n_slots                  # the pool's spare slot
        self.capture_wanted = capture
        self.buckets = {b: _Bucket(b, self.device) for b in buckets(n_slots)}
        self.captured = False
        self.reason = "eager: the fixed-shape step, not captured" if not capture else "not captured yet"
        self.steps = 0                        # steps run through here (replays, or eager steps)

    def capture(self) -> None:
        """Capture every bucket (warm-up runs first, on a side stream, as CUDA graphs need);
        on failure, fall back to eager steps and keep the reason."""
        if not self.capture_wanted:
            return
        try:
            pool = None
            for b in self.buckets.values():
                self._pad(b, 0)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._eager(b)
                torch.cuda.current_stream(self.device).wait_stream(side)
                b.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(b.graph, pool=pool):
                    b.out = self._eager(b)
                pool = b.graph.pool()
            self.captured = True
            self.reason = f"captured: buckets {', '.join(map(str, self.buckets))}"
        except Exception as e:   # a kernel that syncs, an allocator refusal: serve without graphs
            for b in self.buckets.values():
                b.graph = None
            self.captured = False
            self.reason = f"capture failed, eager fixed-shape steps ({type(e).__name__}: {str(e)[:200]})"
            log.warning("CUDA graph capture failed: %s", self.reason)

    def __call__(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """Logits [B, V] float32 for B rows (token, position, slot), one token a sequence."""
        n = len(tokens)
        b = self.buckets[next(r for r in self.buckets if r >= n)]
        self.steps += 1
        b.host[0, :n] = torch.as_tensor(tokens)
        b.host[1, :n] = torch.as_tensor(positions)
        b.host[2, :n] = torch.as_tensor(slots)
        self._pad(b, n)
        b.inputs.copy_(b.host, non_blocking=True)
        if b.graph is not None:
            b.graph.replay()
            out = b.out
        else:
            out = self._eager(b)
        return out[:n]

    def _pad(self, b: _Bucket, n: int) -> None:
        b.host[0, n:], b.host[1, n:], b.host[2, n:] = 0, 0, self.spare
        if n == 0:
            b.inputs.copy_(b.host)

    def _eager(self, b: _Bucket) -> torch.Tensor:
        tokens, positions, slots = b.inputs
        return self.model.step(tokens, positions, slots, self.kv)

    def settings(self) -> dict:
        return {"graphs": "captured" if self.captured else ("eager" if not self.capture_wanted else "failed"),
                "graph_buckets": list(self.buckets), "graphs_note": self.reason}
