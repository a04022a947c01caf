"""NVIDIA GPUs through `nvidia-smi --query-gpu`, run by the injected runner (no NVML needed)."""
from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence

from .facts import Fs, Runner, Unavailable
from .gpu_types import GpuInfo

GPU_FIELDS = ("index", "name", "pci.bus_id", "driver_version", "memory.total", "compute_cap",
              "clocks.sm", "clocks.max.sm")
POWER_FIELDS = ("index", "power.draw", "power.limit", "power.default_limit", "power.max_limit",
                "power.min_limit")
SAMPLE_FIELDS = ("index", "power.draw", "clocks.sm")

# compute capability major.minor -> architecture (sm_121 is GB10, DGX Spark: unified memory)
_ARCH = {"7.0": "Volta", "7.2": "Volta", "7.5": "Turing", "8.0": "Ampere", "8.6": "Ampere",
         "8.7": "Ampere", "8.9": "Ada", "9.0": "Hopper", "10.0": "Blackwell", "10.3": "Blackwell",
         "11.0": "Blackwell", "12.0": "Blackwell", "12.1": "Blackwell"}
# Parts whose GPU shares the host's memory (no dedicated VRAM).
_UNIFIED_NAMES = ("GB10", "Orin", "Thor", "Xavier")


def query(run: Runner, fields: Sequence[str]) -> list[dict[str, str | None]] | Unavailable:
    """One row per GPU; values as nvidia-smi prints them without units, None where [N/A]."""
    out = run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if isinstance(out, Unavailable):
        return out
    rows = []
    for cells in csv.reader(io.StringIO(out), skipinitialspace=True):
        if not cells:
            continue
        if len(cells) != len(fields):
            return Unavailable(f"nvidia-smi printed {len(cells)} columns for {len(fields)} fields")
        rows.append({f: (None if c.strip().startswith("[") else c.strip())
                     for f, c in zip(fields, cells)})
    return rows if rows else Unavailable("nvidia-smi listed no GPUs")


def number(row: dict[str, str | None], key: str) -> float | Unavailable:
    raw = row.get(key)
    if raw is None:
        return Unavailable(f"nvidia-smi reports {key} as not available")
    try:
        return float(raw)
    except ValueError:
        return Unavailable(f"nvidia-smi printed {key}={raw!r}")


def probe_nvidia(fs: Fs, run: Runner) -> list[GpuInfo] | Unavailable:
    rows = query(run, GPU_FIELDS)
    if isinstance(rows, Unavailable):
        return rows
    runtime = _cuda_version(run)
    return [_gpu(row, runtime) for row in rows]


def _gpu(row: dict[str, str | None], runtime: str | Unavailable) -> GpuInfo:
    name = row.get("name") or "NVIDIA GPU"
    cap = row.get("compute_cap")
    arch: str | Unavailable = Unavailable("nvidia-smi gave no compute_cap")
    if cap:
        arch = f"sm_{cap.replace('.', '')}" + (f" ({_ARCH[cap]})" if cap in _ARCH else "")
    unified = any(n in name for n in _UNIFIED_NAMES)
    vram = number(row, "memory.total")
    return GpuInfo(
        vendor="NVIDIA", name=name, arch=arch,
        pci_slot=_slot(row.get("pci.bus_id")) or Unavailable("nvidia-smi gave no pci.bus_id"),
        driver=f"nvidia {row['driver_version']}" if row.get("driver_version") else Unavailable(
            "nvidia-smi gave no driver_version"),
        runtime=runtime,
        vram_bytes=int(vram * 2**20) if isinstance(vram, float) else vram,
        gtt_bytes=Unavailable("GTT is an amdgpu concept"),
        unified=unified,
        cur_mhz=number(row, "clocks.sm"), max_mhz=number(row, "clocks.max.sm"),
        source="nvidia-smi",
    )


def _slot(bus_id: str | None) -> str | None:
    """nvidia-smi's 00000000:01:00.0 -> sysfs's 0000:01:00.0."""
    if not bus_id:
        return None
    domain, _, rest = bus_id.lower().partition(":")
    return f"{domain[-4:]}:{rest}" if rest else bus_id.lower()


def _cuda_version(run: Runner) -> str | Unavailable:
    out = run(["nvidia-smi"])
    if isinstance(out, Unavailable):
        return out
    m = re.search(r"CUDA Version\s*:\s*([\d.]+)", out)
    if m is None:
        return Unavailable("nvidia-smi's header names no CUDA Version")
    return f"CUDA {m.group(1)} (the driver's)"


def driver_from_proc(fs: Fs) -> str | Unavailable:
    """/proc/driver/nvidia/version, for when nvidia-smi is missing but the module is loaded."""
    text = fs.read("/proc/driver/nvidia/version")
    if isinstance(text, Unavailable):
        return text
    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+([\d.]+)", text)
    return f"nvidia {m.group(1)}" if m else Unavailable("unrecognised /proc/driver/nvidia/version")
