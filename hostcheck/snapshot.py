"""One record of the host's conditions, the thing stored beside every measured figure."""
from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cpu import CpuInfo, probe_cpu
from .facts import Runner, Unavailable, cached, run_command, to_jsonable
from .gpu import probe_gpus
from .gpu_types import GpuReport
from .iommu import IommuInfo, probe_iommu
from .kernel import KernelInfo, probe_kernel
from .memory import MemoryInfo, probe_memory
from .power import PowerInfo, probe_power

SCHEMA = 1  # bump when a field changes meaning; stored snapshots carry it


@dataclass(frozen=True)
class HostSnapshot:
    taken_at: str                # UTC, ISO 8601
    cpu: CpuInfo
    memory: MemoryInfo
    kernel: KernelInfo
    gpu: GpuReport
    iommu: IommuInfo
    power: PowerInfo
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: each unavailable fact becomes {"unavailable": reason}."""
        return to_jsonable(self)

    def unavailable(self) -> list[tuple[str, str]]:
        """(dotted field name, reason) for every fact this host did not expose."""
        out = list(_walk_unavailable(self, ""))
        if not self.gpu.gpus:
            out.append(("gpu.gpus", "; ".join(self.gpu.not_found) or "none found"))
        if not self.power.domains:
            out.append(("power.domains", "; ".join(self.power.not_found) or "none found"))
        return out


def collect(root: str | Path = "/", run: Runner = run_command, power_interval_s: float = 0.25,
            sleep: Callable[[float], None] = time.sleep,
            clock: Callable[[], float] = time.monotonic) -> HostSnapshot:
    """Run every probe once. Never raises for a missing fact; it is recorded as unavailable."""
    run = cached(run)  # nvidia-smi and rocminfo answer several probes
    return HostSnapshot(
        taken_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        cpu=probe_cpu(root, run),
        memory=probe_memory(root, run),
        kernel=probe_kernel(root, run),
        gpu=probe_gpus(root, run),
        iommu=probe_iommu(root, run),
        power=probe_power(root, run, interval_s=power_interval_s, sleep=sleep, clock=clock),
    )


def _walk_unavailable(obj: Any, prefix: str) -> Iterator[tuple[str, str]]:
    if isinstance(obj, Unavailable):
        yield prefix, obj.reason
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk_unavailable(getattr(obj, f.name), f"{prefix}.{f.name}".lstrip("."))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk_unavailable(item, f"{prefix}[{i}]")
