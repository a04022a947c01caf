"""Expert offload for the torch runner's MoE layers: every expert has a copy in host memory, and
a device pool of expert slots, shared by all layers, holds the ones the router uses most.

Layout (F expert width, D model width, X experts per layer, S slots):

    host copies   per layer gate [X, F, D], up [X, F, D], down [X, D, F] in the compute dtype,
                  in host memory (pinned when the device is a discrete card, so copies can run
                  on a side stream)
    device pool   gate and up stacked [S, 2F, D], down [S, D, F]; `slot_of[layer, e]` is
                  the slot holding expert e of that layer, or -1

One MoE layer's call (`ExpertCache.layer`), after the router chose each row's k experts:

    1. value: the layer's scores decay by `decay` and gain each expert's routed rows
       (frequency with decay: an expert used once by a scan does not push out one used by
       every other token, as recency alone would let it)
    2. each routed expert in ascending order: resident, a hit, computed from its slot; missing,
       the cost model chooses for that expert and its row count whether to copy it into a slot
       (evicting the resident of least value that this call does not use) and compute it
       there, or to compute it on the host from its host copy (one token needing one expert:
       the host; a prefill chunk giving an expert hundreds of rows: the copy)
    3. promotion: the layer's non-resident experts whose value beats the least valuable
       resident's by `hysteresis` take its slot, at most `promote` per call, so decode steps
       that compute misses on the host still steer the cache. On a GPU these copies run on a
       side stream and a slot is awaited before it is next read.

With the Triton kernels on (`grouped=True`), the experts computed on the device go through
the grouped kernel in one launch per matrix, slots for expert numbers (`grouped.py`), and
those computed on the host through `swiglu`; each row's k outputs are summed by
`grouped.combine`.

Numerics: a slot holds the host copy's values and every expert goes through `swiglu`, so where
the weights came from does not change a result on the same device; with both "devices" in CPU
memory (CPU-only hosts, tests) the output equals the all-resident runner bit for bit. On a GPU
an expert computed on the host uses the CPU's kernels, and whether it is depends on the batch:
with `--expert-compute auto|cpu` there a row may differ in the last bits between a step and a
verify, which the start-up check (probe.check_exact) finds, turning speculation off;
`--expert-compute device` keeps the runner exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...stats import ExpertStats
from . import grouped as grouped_mod
from .expert_policy import DECAY, POLICIES  # noqa: F401  (DECAY re-exported)
from .rows import pad_rows

COMPUTE_MODES = ("auto", "cpu", "device")
HYSTERESIS = 1.25    # a promotion needs this much more value than the resident it replaces
PROMOTE = 2          # promotions per layer call, bounding copy traffic in decode


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert over its rows: h [R, D] in the weights' dtype -> [R, D]. On a CPU the rows are
    padded (`rows.pad_rows`), so a row's result does not depend on how many rows its expert got."""
    m = h.shape[0]
    h = pad_rows(h)
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)[:m]


def swiglu_oai(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """gpt-oss's expert (`swiglu` with llama.cpp's ggml_swiglu_oai, `grouped.oai_glu`): biased
    gate, up and down; the matmuls in the weights' dtype, the rest in float32, rows padded."""
    m = h.shape[0]
    h = pad_rows(h)
    a = grouped_mod.oai_glu(F.linear(h, gate)[:m].float() + biases[0], F.linear(h, up)[:m].float() + biases[1])
    return F.linear(pad_rows(a.to(down.dtype)), down)[:m].float() + biases[2]


def group_by_expert(chosen: torch.Tensor, n_expert: int,
                    host: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """chosen [N, k] -> (rows, which, counts): the (row, choice) pairs sorted by expert, rows
    ascending within an expert (a stable sort), and each expert's row count [X] on the host.
    `host`, chosen already copied to the host, saves a second device-to-host transfer."""
    k = chosen.shape[1]
    order = torch.argsort(chosen.flatten(), stable=True)
    if host is None:
        counts = torch.bincount(chosen.flatten(), minlength=n_expert).cpu().numpy()
    else:
        counts = np.bincount(host.ravel(), minlength=n_expert)
    return order // k, order % k, counts


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor, np.ndarray],
            expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Grouped expert compute: x [N, D] float32, the router's weights [N, k], the rows grouped
    by `group_by_expert` -> [N, D] float32. One call of `expert(e, rows of x)` per routed expert,
    in ascending order, each adding its weighted rows."""
    rows, which, counts = groups
    out = torch.zeros_like(x)
    at = 0
    for e in np.flatnonzero(counts).tolist():
        r = slice(at, at + int(counts[e]))
        at = r.stop
        y = expert(e, x[rows[r]])
        out.index_add_(0, rows[r], y.float() * weights[rows[r], which[r], None])
    return out


# -- cost ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertCosts:
    """Seconds for one expert: copying it host -> device, and computing r rows of it as
    fixed + r x per_row on each side (fixed: reading its weights, which dominates at few rows)."""

    copy_s: float
    host: tuple[float, float]      # (fixed, per row)
    device: tuple[float, float]

    def choose(self, rows: int) -> str:
        """'host' or 'copy' for a missing expert given `rows` rows in this call."""
        host = self.host[0] + rows * self.host[1]
        there = self.copy_s + self.device[0] + rows * self.device[1]
        return "host" if host <= there else "copy"


def _median_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# -- the cache ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OffloadSpec:
    """What `model.load` builds the cache from: its slots and its choices."""

    slots: int
    compute: str = "auto"
    policy: str = "frequency"
    costs: ExpertCosts | None = None     # None: measured at start
    n_seq: int = 1                       # sequence slots, for per-request hit rates


@dataclass
class ExpertCounters:
    lookups: int = 0          # (row, expert) pairs routed
    hits: int = 0             # ... whose expert was in the pool
    copies: int = 0           # experts copied into the pool (misses copied in, promotions)
    promotions: int = 0
    bytes_copied: int = 0
    host_rows: int = 0        # rows computed on the host from the host copy


class ExpertCache:
    """The host copies, the device pool and the policy for every MoE layer of one model."""

    def __init__(self, host: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], slots: int,
                 device: torch.device, compute: str = "auto", policy: str = "frequency",
                 costs: ExpertCosts | None = None, n_seq: int = 1, promote: int = PROMOTE,
                 hysteresis: float = HYSTERESIS, grouped: bool = False, biases: Sequence[tuple] | None = None) -> None:
        if compute not in COMPUTE_MODES:
            raise ValueError(f"expert compute must be one of {', '.join(COMPUTE_MODES)}, not {compute!r}")
        self.host = list(host)                        # per layer (gate, up, down), host memory
        gate, up, down = self.host[0]
        self.n_layer, self.n_expert = len(self.host), gate.shape[0]
        self.slots, self.device, self.compute = max(0, slots), device, compute
        self.ff, self.grouped = gate.shape[1], grouped
        self.pool = (torch.empty((self.slots, 2 * self.ff, gate.shape[2]), dtype=gate.dtype, device=device),
                     torch.empty((self.slots, *down.shape[1:]), dtype=down.dtype, device=device))
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in (gate, up, down))
        # gpt-oss: per layer its experts' gate, up, down biases (host), and each slot's on the device
        self.biases = list(biases) if biases is not None else None
        self.pool_biases = (tuple(torch.empty((self.slots, b.shape[1]), device=device) for b in self.biases[0])
                            if self.biases is not None else None)
        self.policy = POLICIES[policy](self.n_layer, self.n_expert)
        self.slot_of = np.full((self.n_layer, self.n_expert), -1)
        self.owner: list[tuple[int, int] | None] = [None] * self.slots     # slot -> (layer, expert)
        self.counters = ExpertCounters()
        self.per_seq = np.zeros((n_seq, 2), dtype=np.int64)               # seq slot -> lookups, hits
        self.row_seq = np.zeros(0, dtype=np.int64)                       # call row -> seq slot
        self.promote, self.hysteresis = promote, hysteresis
        self.same_memory = device.type == "cpu"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}
        self.costs = costs or self.measure_costs()
        self.copy_gb_per_s = self.expert_bytes / self.costs.copy_s / 1e9 if self.costs.copy_s > 0 else 0.0

    # -- the forward's hooks ----------------------------------------------------------------
    def begin(self, row_seq: np.ndarray) -> None:
        """The next forward's rows, by the sequence slot each belongs to (per-request hit rates)."""
        self.row_seq = np.asarray(row_seq, dtype=np.int64)

    def layer(self, layer: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The MoE FFN of `layer` for x [N, D] float32, rows routed to chosen [N, k] with weights
        [N, k] float32 -> [N, D] float32, each expert computed from its slot or its host copy."""
        ch = chosen.cpu().numpy()                                          # one transfer a layer
        groups = group_by_expert(chosen, self.n_expert, host=ch)
        counts = groups[2]
        self.policy.observe(layer, counts)
        used = np.flatnonzero(counts)
        self._account(layer, ch)
        if self.grouped:
            out = self._grouped(layer, x, ch, weights, used)
            self._promote(layer, used)
            return out
        dtype = self.pool[0].dtype

        def expert(e: int, h: torch.Tensor) -> torch.Tensor:
            h = h.to(dtype)
            slot = int(self.slot_of[layer, e])
            if slot < 0 and self._placement(h.shape[0]) == "copy":
                slot = self._load(layer, e, avoid=used)
            if slot < 0:
                return self._host_compute(layer, e, h)
            self._await(slot)
            return self._swiglu(h, self.pool[0][slot, :self.ff], self.pool[0][slot, self.ff:], self.pool[1][slot],
                                self.pool_biases, slot)
        out = moe_ffn(x, weights, groups, expert)
        self._promote(layer, used)
        return out

    def _grouped(self, layer: int, x: torch.Tensor, ch: np.ndarray, weights: torch.Tensor,
                 used: np.ndarray) -> torch.Tensor:
        """The kernels' path: the experts placed on the device (hits, and misses copied in) in
        one grouped call over the pool, the rest on the host, each pair's output then summed."""
        rows, which, counts = grouped_mod.host_groups(ch, self.n_expert)
        start = np.concatenate(([0], np.cumsum(counts)))
        slots = np.full(self.n_expert, -1)
        for e in used.tolist():
            slot = int(self.slot_of[layer, e])
            if slot < 0 and self._placement(int(counts[e])) == "copy":
                slot = self._load(layer, e, avoid=used)
            if slot >= 0:
                self._await(slot)
            slots[e] = slot
        y = x.new_empty(len(rows), x.shape[1])
        on = slots >= 0
        at = np.concatenate([np.arange(start[e], start[e + 1]) for e in np.flatnonzero(on)] or [np.zeros(0, int)])
        if len(at):
            mats = grouped_mod.ExpertMats(self.pool[0], self.pool[1], None, x.shape[1], self.ff, self.pool_biases)
            y[torch.from_numpy(at).to(x.device)] = grouped_mod.pair_outputs(
                x, mats, rows[at], np.where(on, counts, 0), np.maximum(slots, 0))
        for e in np.flatnonzero(~on & (counts > 0)).tolist():
            r = rows[start[e]:start[e + 1]]
            h = x[torch.from_numpy(r).to(x.device)].to(self.pool[0].dtype)
            y[start[e]:start[e + 1]] = self._host_compute(layer, e, h).float()
        return grouped_mod.combine(y, rows, which, weights)

    def _placement(self, rows: int) -> str:
        if self.slots == 0 or self.compute == "cpu":
            return "host"
        return "copy" if self.compute == "device" else self.costs.choose(rows)

    def _host_compute(self, layer: int, e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.host[layer]
        self.counters.host_rows += h.shape[0]
        biases = self.biases[layer] if self.biases is not None else None
        if self.same_memory:
            return self._swiglu(h, gate[e], up[e], down[e], biases, e)
        return self._swiglu(h.to("cpu"), gate[e], up[e], down[e], biases, e).to(self.device, non_blocking=True)

    @staticmethod
    def _swiglu(h, gate, up, down, biases, at: int) -> torch.Tensor:
        """`swiglu`, or gpt-oss's with the biases at row `at` of `biases` (an expert's or a slot's)."""
        return swiglu(h, gate, up, down) if biases is None else swiglu_oai(h, gate, up, down, tuple(b[at] for b in biases))

    def _account(self, layer: int, ch: np.ndarray) -> None:
        hit = self.slot_of[layer][ch] >= 0                                 # [N, k]
        self.counters.lookups += ch.size
        self.counters.hits += int(hit.sum())
        if len(self.row_seq) == ch.shape[0]:
            np.add.at(self.per_seq, (self.row_seq, 0), ch.shape[1])
            np.add.at(self.per_seq, (self.row_seq, 1), hit.sum(1))

    # -- slots ------------------------------------------------------------------------------
    def _victim(self, avoid: np.ndarray | None, layer: int) -> int:
        """A free slot, else the resident of least value (not one this layer's call uses)."""
        free = [s for s, o in enumerate(self.owner) if o is None]
        if free:
            return free[0]
        busy = set(avoid.tolist()) if avoid is not None else set()
        values = [(self.policy.value(*o), s) for s, o in enumerate(self.owner)
                  if o is not None and not (o[0] == layer and o[1] in busy)]
        if not values:
            values = [(self.policy.value(*o), s) for s, o in enumerate(self.owner) if o is not None]
        return min(values)[1]

    def _load(self, layer: int, e: int, avoid: np.ndarray | None = None, side: bool = False) -> int:
        """Copy expert e of layer into a slot (evicting its owner) -> the slot."""
        slot = self._victim(avoid, layer)
        self._await(slot)   # a side-stream copy still landing there
        old = self.owner[slot]
        if old is not None:
            self.slot_of[old] = -1
        stream = self._stream if side and self._stream is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))   # the slot's last readers first
            with torch.cuda.stream(stream):
                self._copy(layer, e, slot)
                ev = torch.cuda.Event()
                ev.record(stream)
            self._ready[slot] = ev
        else:
            self._copy(layer, e, slot)
        self.owner[slot] = (layer, e)
        self.slot_of[layer, e] = slot
        self.counters.copies += 1
        self.counters.bytes_copied += self.expert_bytes
        return slot

    def _copy(self, layer: int, e: int, slot: int) -> None:
        gate, up, down = self.host[layer]
        pairs = [(self.pool[0][slot, :self.ff], gate), (self.pool[0][slot, self.ff:], up), (self.pool[1][slot], down)]
        if self.biases is not None:
            pairs += [(pool[slot], host) for pool, host in zip(self.pool_biases, self.biases[layer])]
        for dst, src in pairs:
            dst.copy_(src[e], non_blocking=not self.same_memory)

    def _await(self, slot: int) -> None:
        ev = self._ready.pop(slot, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _promote(self, layer: int, used: np.ndarray) -> None:
        """Let the experts this call routed to and the pool lacks in, most valuable first, when
        a slot is free or (frequency) they beat the least valuable resident by `hysteresis`."""
        if self.slots == 0:
            return
        score = self.policy.score[layer]
        missing = [int(e) for e in used[np.argsort(-score[used], kind="stable")] if self.slot_of[layer, e] < 0]
        for e in missing[:self.promote]:
            old = self.owner[self._victim(None, -1)]
            if (old is not None and self.policy.name == "frequency"
                    and not score[e] > self.hysteresis * self.policy.value(*old)):
                break
            self._load(layer, e, side=True)
            self.counters.promotions += 1

    # -- costs and reports ------------------------------------------------------------------
    def measure_costs(self) -> ExpertCosts:
        """Time one expert's copy and its compute at 1 and 64 rows on each side (median of 5)."""
        gate, up, down = (t[0] for t in self.host[0])
        dev = self.device
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        dst = tuple(torch.empty_like(t, device=dev) for t in (gate, up, down))
        copy_s = _median_time(lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dst, (gate, up, down))], sync)

        def line(on: torch.device, w: tuple[torch.Tensor, ...]) -> tuple[float, float]:
            with torch.inference_mode():
                one = _median_time(lambda: swiglu(torch.zeros(1, gate.shape[1], dtype=gate.dtype, device=on), *w), sync)
                many = _median_time(lambda: swiglu(torch.zeros(64, gate.shape[1], dtype=gate.dtype, device=on), *w), sync)
            per_row = max(0.0, (many - one) / 63)
            return max(0.0, one - per_row), per_row
        host = line(torch.device("cpu"), (gate, up, down))
        device = host if self.same_memory else line(dev, dst)
        return ExpertCosts(copy_s, host, device)

    def seq_counts(self, seq: int) -> tuple[int, int]:
        """(lookups, hits) of the rows of sequence slot `seq` so far."""
        lookups, hits = self.per_seq[seq]
        return int(lookups), int(hits)

    def stats(self) -> ExpertStats:
        c = self.counters
        return ExpertStats(slots=self.slots, experts=self.n_layer * self.n_expert,
                           resident=sum(o is not None for o in self.owner), lookups=c.lookups, hits=c.hits,
                           copies=c.copies, promotions=c.promotions, bytes_copied=c.bytes_copied,
                           host_rows=c.host_rows, compute=self.compute, policy=self.policy.name,
                           copy_gb_per_s=round(self.copy_gb_per_s, 3))
