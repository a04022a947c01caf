"""How many expert slots the torch runner's device pool gets: a pure function of the device's
memory, what else the device holds, and the experts' sizes (the expert half of the fit planner;
`planner.py` places llama.cpp's tensors, this sizes the torch runner's expert cache).

    --expert-cache off    every expert resident on the device (no cache)
    --expert-cache N      N slots, whatever the memory (on a CPU-only host both "devices" are
                          host memory: for tests and for measuring the policy)
    --expert-cache auto   a CPU-only host or an APU, whose GPU maps host memory: no cache (one
                          memory; on an APU mapping the host copy beats copying it); a discrete
                          card: no cache when every expert fits beside the rest, else as many
                          slots as fit in the headroom

Scarce device memory goes first to what every token reads (attention, shared weights, the KV
pool, the compute buffers), as `planner.py` orders llama.cpp's placement, and then to experts.
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import GIB, Device

COMPUTE = ("auto", "cpu", "device")


@dataclass(frozen=True)
class ExpertPlan:
    slots: int | None          # None: no cache, every expert resident
    compute: str               # where a missing expert is computed: auto (the cost model) | cpu | device
    reason: str

    def to_dict(self) -> dict:
        return {"slots": self.slots, "compute": self.compute, "reason": self.reason}


def parse_setting(value: str) -> int | None | str:
    """--expert-cache's value: 'auto', None for 'off', or a slot count."""
    v = value.strip().lower()
    if v in ("auto", "off"):
        return None if v == "off" else "auto"
    if not v.isdigit():
        raise ValueError(f"expert_cache must be a slot count, auto or off, not {value!r}")
    return int(v)


def plan_experts(setting: str, compute: str, *, n_experts: int, expert_bytes: int,
                 device: Device | None, resident_bytes: int) -> ExpertPlan:
    """The cache for a model of `n_experts` routed experts (all layers) of `expert_bytes` each,
    whose other tensors, KV and buffers take `resident_bytes` on `device` (None: a CPU-only host)."""
    if compute not in COMPUTE:
        raise ValueError(f"expert_compute must be one of {', '.join(COMPUTE)}, not {compute!r}")
    want = parse_setting(setting)
    if n_experts == 0:
        return ExpertPlan(None, compute, "the model has no routed experts")
    if want is None:
        return ExpertPlan(None, compute, "--expert-cache off: every expert resident")
    if isinstance(want, int):
        slots = min(want, n_experts)
        return ExpertPlan(slots, "cpu" if slots == 0 and compute == "auto" else compute,
                          f"--expert-cache {want}: {slots} of {n_experts} experts' slots")
    if device is None or device.kind == "cpu":
        return ExpertPlan(None, compute, "CPU only: one memory, every expert resident")
    if device.unified:
        return ExpertPlan(None, compute, f"{device.name} maps host memory: every expert resident, none copied")
    headroom = device.budget - resident_bytes
    need = n_experts * expert_bytes
    if headroom >= need:
        return ExpertPlan(None, compute, f"every expert fits on {device.name} ({need / GIB:.2f} GiB of "
                                         f"{headroom / GIB:.2f} GiB free after the rest)")
    slots = max(0, headroom // expert_bytes)
    return ExpertPlan(slots, "cpu" if slots == 0 and compute == "auto" else compute,
                      f"{need / GIB:.2f} GiB of experts, {max(headroom, 0) / GIB:.2f} GiB free on {device.name} "
                      f"after the rest: {slots} of {n_experts} in a device cache, the rest in host memory")
