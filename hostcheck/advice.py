"""Settings known to cost performance, each with the setting to change. Pure: snapshot in, list out.

The evidence is seed 003's: on a Ryzen AI Max+ 395 the IOMMU in passthrough (`iommu=pt`) cost
13-16% of prefill against the IOMMU off (the SoC drew more power for lower shader clocks),
and a 70 W power limit cost 11-12% of decode. Translated mode was not measured there, so it
gets a note, not a warning.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from .facts import Unavailable, known
from .gpu_types import GpuInfo
from .snapshot import HostSnapshot

GIB = 2**30
REBOOT = ("edit GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub and run update-grub "
          "(Fedora: grubby --update-kernel=ALL --args=...), then reboot")


@dataclass(frozen=True)
class Advice:
    severity: str       # "warning": known to cost performance; "note": worth a look
    setting: str        # the setting, as a user would search for it
    message: str        # what was found and what it costs
    fix: str            # what to change, and where


@dataclass(frozen=True)
class LlamaDevice:
    name: str                    # "CPU", "CUDA0", "Vulkan0", ...
    description: str
    free_bytes: int
    total_bytes: int
    kind: str = ""               # ggml's: cpu | gpu | igpu | accel ("": not said)
    host_memory: bool = False    # a GPU whose memory is the host's (integrated, or software on the CPU)


@dataclass(frozen=True)
class LlamaBuild:
    """What the installed llama.cpp can drive, as it says itself (`llama_supports_gpu_offload`
    and ggml's device registry): the caller reads it, since hostcheck imports no engine."""

    version: str
    gpu_offload: bool
    devices: tuple[LlamaDevice, ...]


# One line per backend, as the README gives them
BUILD_LINES = {
    "vulkan": 'CMAKE_ARGS="-DGGML_VULKAN=on" pip install --force-reinstall --no-cache-dir llama-cpp-python',
    "hip": 'CMAKE_ARGS="-DGGML_HIP=on -DAMDGPU_TARGETS={arch}" pip install --force-reinstall --no-cache-dir '
           'llama-cpp-python',
    "cuda": 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python',
}


def check(snap: HostSnapshot, model_bytes: int | None = None, llama: LlamaBuild | None = None) -> list[Advice]:
    out: list[Advice] = []
    out += _iommu(snap)
    out += _governor(snap)
    if model_bytes is not None:
        out += _model_fit(snap, model_bytes)
    out += _power_caps(snap)
    if llama is not None:
        out += _llama_build(snap, llama)
    return out


def _llama_build(snap: HostSnapshot, llama: LlamaBuild) -> list[Advice]:
    """A GPU on the host that the installed llama.cpp cannot use: the reinstall line for it."""
    if llama.gpu_offload or not snap.gpu.gpus:
        return []
    g = snap.gpu.gpus[0]
    name = g.name if known(g.name) else f"{g.vendor} GPU"
    if g.vendor == "NVIDIA":
        line = BUILD_LINES["cuda"]
    elif g.vendor == "AMD":
        arch = g.arch if isinstance(g.arch, str) and g.arch.startswith("gfx") else "gfx1151"
        line = f"{BUILD_LINES['vulkan']} (Vulkan, the simplest); or ROCm: {BUILD_LINES['hip'].format(arch=arch)}"
    else:
        line = BUILD_LINES["vulkan"]
    return [Advice("warning", "llama.cpp without a GPU backend",
                   f"{name} is present, but the installed llama.cpp was built for the CPU only "
                   f"(its devices: {', '.join(d.name for d in llama.devices) or 'none'}): every layer runs on the CPU",
                   f"reinstall it with a GPU backend: {line}")]


def _apus(snap: HostSnapshot) -> list[GpuInfo]:
    return [g for g in snap.gpu.gpus if g.unified is True]


def _iommu_off_param(snap: HostSnapshot) -> str:
    vendor = snap.cpu.vendor
    return {"AuthenticAMD": "amd_iommu=off", "GenuineIntel": "intel_iommu=off"}.get(
        vendor if isinstance(vendor, str) else "", "iommu=off")


def _iommu(snap: HostSnapshot) -> list[Advice]:
    apus, mode = _apus(snap), snap.iommu.mode
    if not apus:
        return []
    off = _iommu_off_param(snap)
    booted = snap.iommu.cmdline
    drop = [f"{k}={v}" for k, v in booted.items()
            if (k, v) in (("iommu", "pt"), ("iommu.passthrough", "1"))]
    change = (f"remove {' '.join(drop)} and add {off}" if drop else f"add {off}")
    if mode == "passthrough":
        return [Advice("warning", "IOMMU passthrough (iommu=pt)",
                       f"the IOMMU is in passthrough on an APU (read from {snap.iommu.source}); "
                       "on a Ryzen AI Max+ 395 that cost 13-16% of prefill against the IOMMU off",
                       f"{change} on the kernel command line: {REBOOT}. Off also gives up DMA "
                       "isolation and VFIO device passthrough to VMs")]
    if mode in ("translated", "mixed"):
        return [Advice("note", "IOMMU translated",
                       f"the IOMMU translates DMA on an APU (read from {snap.iommu.source}); not "
                       "measured, but the IOMMU off was the fast setting against passthrough",
                       f"to compare, {change} on the kernel command line: {REBOOT}")]
    if isinstance(mode, Unavailable):
        return [Advice("note", "IOMMU", f"could not tell the IOMMU mode on an APU: {mode.reason}",
                       "check /sys/kernel/iommu_groups/*/type as root")]
    return []


def _governor(snap: HostSnapshot) -> list[Advice]:
    gov = snap.cpu.governor
    if not isinstance(gov, str) or "powersave" not in gov:
        return []
    epp = snap.cpu.energy_perf_preference
    driver = snap.cpu.scaling_driver
    extra = f" (driver {driver}, energy_performance_preference {epp})" if known(epp) else ""
    return [Advice("warning", "CPU governor powersave",
                   f"the CPU frequency governor is {gov}{extra}: clocks are held down between "
                   "bursts, which slows tokenization, sampling and CPU-side compute",
                   "sudo cpupower frequency-set -g performance (or write performance to "
                   "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor); to keep it across "
                   "boots, set it in your power profile (tuned-adm profile "
                   "throughput-performance, or powerprofilesctl set performance)")]


def _model_fit(snap: HostSnapshot, model_bytes: int) -> list[Advice]:
    out = []
    size = f"{model_bytes / GIB:.1f} GiB"
    for g in snap.gpu.gpus:
        if g.unified is True and g.vendor == "AMD":
            out += _gtt_fit(snap, g, model_bytes, size)
        elif g.unified is False and isinstance(g.vram_bytes, int) and model_bytes > g.vram_bytes:
            out.append(Advice(
                "warning", "model larger than VRAM",
                f"the model ({size}) is larger than {g.name if known(g.name) else 'the GPU'}'s "
                f"{g.vram_bytes / GIB:.1f} GiB of VRAM: layers will run from host memory",
                "use a smaller quantization or a second GPU; layers that do not fit run at "
                "host-memory speed"))
    total = snap.memory.total_bytes
    if isinstance(total, int) and model_bytes > total:
        out.append(Advice("warning", "model larger than memory",
                          f"the model ({size}) is larger than the {total / GIB:.1f} GiB of memory",
                          "use a smaller quantization"))
    return out


def _gtt_fit(snap: HostSnapshot, g: GpuInfo, model_bytes: int, size: str) -> list[Advice]:
    limits = snap.gpu.gtt_limits
    candidates = {"mem_info_gtt_total": g.gtt_bytes}
    if not isinstance(limits, Unavailable) and limits.ttm_limit_bytes is not None:
        candidates["ttm.pages_limit"] = limits.ttm_limit_bytes
    found = {k: v for k, v in candidates.items() if isinstance(v, int)}
    if not found:
        return [Advice("note", "GTT size", f"could not read the GTT limit to check a {size} model: "
                       f"{g.gtt_bytes.reason if isinstance(g.gtt_bytes, Unavailable) else '?'}",
                       "check /sys/class/drm/card*/device/mem_info_gtt_total")]
    name, limit = min(found.items(), key=lambda kv: kv[1])
    if model_bytes <= limit:
        return []
    target = _gtt_target(snap, model_bytes)
    pages, mib = target // 4096, target // 2**20
    return [Advice(
        "warning", "GTT limit below the model's size",
        f"the GPU can map {limit / GIB:.1f} GiB of system memory ({name}), less than the "
        f"model's {size}: it will not load on the GPU, or spill",
        f"add ttm.pages_limit={pages} (4 KiB pages, {target / GIB:.0f} GiB) to the kernel command "
        f"line (older kernels: also amdgpu.gttsize={mib}, in MiB): {REBOOT}")]


def _gtt_target(snap: HostSnapshot, model_bytes: int) -> int:
    """Leave the OS 8 GiB of the memory; never less than the model plus a quarter for KV."""
    want = math.ceil(model_bytes * 1.25 / GIB) * GIB
    total = snap.memory.total_bytes
    if isinstance(total, int):
        return max(want, (total // GIB - 8) * GIB)
    return want


def _power_caps(snap: HostSnapshot) -> list[Advice]:
    out = []
    for d in snap.power.domains:
        cap, default = d.cap_w, d.default_cap_w
        if not (isinstance(cap, float) and isinstance(default, float)) or cap >= default * 0.98:
            continue
        if d.kind == "nvidia":
            index = d.label.rsplit(" ", 1)[-1]
            fix = f"sudo nvidia-smi -i {index} -pl {default:.0f}"
        else:
            fix = (f"echo {int(default * 1e6)} | sudo tee {d.path}/power1_cap (resets at boot), "
                   "or raise the platform power mode in the firmware or vendor tool")
        out.append(Advice("warning", f"power cap ({d.label})",
                          f"{d.label} is capped at {cap:.0f} W, below its default {default:.0f} W; "
                          "a lower envelope costs speed (on a Ryzen AI Max+ 395 a 70 W limit cost "
                          "11-12% of decode)",
                          fix))
    return out


def model_bytes_of(path: str | Path) -> int:
    """Bytes of a model on disk: a file, all parts of a split GGUF (-00001-of-00003.gguf), or
    every file in a directory (safetensors shards). Raises OSError when it cannot be read."""
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", p.name)
    if m is None:
        return p.stat().st_size
    n = int(m.group(3))
    return sum((p.parent / f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf").stat().st_size
               for i in range(1, n + 1))
