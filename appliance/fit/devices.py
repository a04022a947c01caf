"""The memory the planner may fill on each device, from a hostcheck snapshot (this host's, or
another's `appliance hostcheck --json`).

    CPU            host memory: the total less the OS's share (RESERVE), and no more than
                   what was available when the snapshot was taken
    discrete GPU   its VRAM less a driver reserve (GPU_RESERVE)
    unified GPU    (an APU) what it can map: the BIOS carve-out plus the GTT, which is capped
                   by amdgpu's GTT size and by ttm.pages_limit, and which is host memory:
                   what the GPU holds beyond the carve-out is taken from the CPU's share too
                   (the planner counts both against one pool, `shares_host`)

Free memory at start (llama.cpp's `ggml_backend_dev_memory`) replaces the snapshot's total for
a device when the engine plans for itself. A GPU that only llama.cpp sees (no PCI display
device: a software Vulkan device such as Mesa's lavapipe) is planned from what llama.cpp
reported in the snapshot (`hostcheck --json`'s "llama_cpp"); one whose memory is the host's (an
integrated GPU, or software on the CPU, which llama.cpp calls a discrete GPU) counts as unified.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GIB = 1024**3


def host_reserve(total: int) -> int:
    """What the OS and everything else keep: a tenth of the memory, at least 2 GiB, at most 8."""
    return min(max(total // 10, 2 * GIB), 8 * GIB)


def gpu_reserve(vram: int) -> int:
    """The driver's and context's share of a discrete card: 5%, at least 512 MiB."""
    return max(vram // 20, GIB // 2)


@dataclass(frozen=True)
class Device:
    name: str                 # "CPU", "GPU0", ...
    kind: str                 # "cpu" | "gpu"
    budget: int               # bytes the planner may fill
    unified: bool = False     # a GPU that maps host memory (an APU, or software on the CPU)
    carve_out: int = 0        # unified: the dedicated (BIOS) part of the budget
    gtt: bool = False         # unified through amdgpu's GTT, whose limit is a kernel setting
    how: str = ""             # how the budget was found, for the report
    remote: bool = False      # another machine's, through llama.cpp's RPC backend (no op offload)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def from_snapshot(snap: dict) -> list[Device]:
    """Devices from a hostcheck snapshot as JSON (`HostSnapshot.to_dict()`, or the whole of
    `appliance hostcheck --json`, which holds it under "snapshot"). The CPU first."""
    llama = snap.get("llama_cpp") if isinstance(snap.get("llama_cpp"), dict) else {}
    snap = snap.get("snapshot", snap)
    mem = snap.get("memory") or {}
    total, avail = _int(mem.get("total_bytes")), _int(mem.get("available_bytes"))
    if total is None:
        raise ValueError("the host snapshot has no memory.total_bytes: cannot plan")
    cpu_budget = total - host_reserve(total)
    how = f"{total / GIB:.1f} GiB less {host_reserve(total) / GIB:.1f} GiB for the OS"
    if avail is not None and avail < cpu_budget:
        cpu_budget, how = avail, f"{avail / GIB:.1f} GiB available"
    devices = [Device("CPU", "cpu", cpu_budget, how=how)]
    gpu = snap.get("gpu") or {}
    limits = gpu.get("gtt_limits") or {}
    ttm_pages = _int(limits.get("ttm_pages_limit")) if isinstance(limits, dict) else None
    for i, g in enumerate(gpu.get("gpus") or []):
        vram = _int(g.get("vram_bytes")) or 0
        if g.get("unified") is True:
            caps = {k: v for k, v in (("GTT size", _int(g.get("gtt_bytes"))),
                                      ("ttm.pages_limit", ttm_pages * 4096 if ttm_pages else None)) if v}
            gtt_name, gtt = min(caps.items(), key=lambda kv: kv[1]) if caps else ("no GTT limit read", 0)
            gtt = min(gtt, cpu_budget)
            devices.append(Device(f"GPU{i}", "gpu", vram + gtt, unified=True, carve_out=vram, gtt=True,
                                  how=f"carve-out {vram / GIB:.1f} GiB + GTT {gtt / GIB:.1f} GiB ({gtt_name})"))
        elif vram:
            devices.append(Device(f"GPU{i}", "gpu", vram - gpu_reserve(vram),
                                  how=f"{vram / GIB:.1f} GiB VRAM less {gpu_reserve(vram) / GIB:.1f} GiB reserve"))
    return devices + ([] if gpu.get("gpus") else _llama_gpus(llama))


def _llama_gpus(llama: dict) -> list[Device]:
    """The GPUs llama.cpp reported when hostcheck found no PCI one: each from its free memory
    (not an RPC worker's: `with_workers` adds those)."""
    out: list[Device] = []
    for d in llama.get("devices") or []:
        if str(d.get("name", "")).startswith("RPC"):
            continue
        free, total = _int(d.get("free_bytes")), _int(d.get("total_bytes"))
        if d.get("kind") in ("gpu", "igpu") and free is not None and total:
            memory = "gtt" if d.get("kind") == "igpu" else "host" if d.get("host_memory") else "own"
            out.append(_measured_gpu(f"GPU{len(out)}", memory, free, total,
                                     f"llama.cpp's {d.get('name')} ({d.get('description')}): "))
    return out


def _measured_gpu(name: str, memory: str, free: int, total: int, what: str = "", remote: bool = False) -> Device:
    """A GPU's budget from its free memory (a small margin stays free). `memory`: "own" (a
    card's VRAM), "gtt" (an integrated GPU: host memory, mapped through amdgpu's GTT on AMD) or
    "host" (software on the CPU, such as lavapipe: host memory, no GTT)."""
    margin = max(total // 50, GIB // 4)
    host = "" if memory == "own" else ", host memory"
    return Device(name, "gpu", max(free - margin, 0), unified=memory != "own", gtt=memory == "gtt", remote=remote,
                  how=f"{what}{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB{host}, less {margin / GIB:.2f} GiB")


def from_measured(host_total: int, host_available: int,
                  gpus: list[tuple[str, str, int, int, bool]]) -> list[Device]:
    """Devices from what the running host reports: its memory (/proc/meminfo) and each GPU's
    (planner name, memory: own | gtt | host, free, total, remote) from llama.cpp's device
    registry (remote: an RPC worker's, which reports its own free memory). A GPU's free memory
    already leaves out what the driver and other processes hold."""
    budget = min(host_total - host_reserve(host_total), host_available)
    out = [Device("CPU", "cpu", budget, how=f"{host_available / GIB:.1f} GiB available of "
                                             f"{host_total / GIB:.1f} GiB, less the OS's share")]
    return out + [_measured_gpu(name, memory, free, total, "RPC worker's " if remote else "", remote)
                  for name, memory, free, total, remote in gpus]


def main_gpu_only(devices: list[Device]) -> list[Device]:
    """The CPU and the first GPU: where serve puts layers without a split (no --rpc or --tensor-split)."""
    gpus = [d for d in devices if d.kind == "gpu"]
    return [d for d in devices if d.kind != "gpu"] + gpus[:1]


def with_workers(devices: list[Device], workers: list[tuple[str, int, int]]) -> list[Device]:
    """This host's devices and RPC workers' (description, free, total), in llama.cpp's order for a
    split: the workers' devices are GPU0, GPU1, ..., this host's GPUs follow them, renumbered."""
    remote = [_measured_gpu(f"GPU{i}", "own", free, total, f"RPC worker {what}: ", remote=True)
              for i, (what, free, total) in enumerate(workers)]
    local = [replace(d, name=f"GPU{len(remote) + i}") for i, d in enumerate(d for d in devices if d.kind == "gpu")]
    return [d for d in devices if d.kind != "gpu"] + remote + local
