"""CPU: model, cores, SMT, frequency governor and clocks, from /proc/cpuinfo and cpufreq sysfs."""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .facts import Fs, Runner, Unavailable, key_values, run_command

CPU = "/sys/devices/system/cpu"


@dataclass(frozen=True)
class CpuInfo:
    model: str | Unavailable
    vendor: str | Unavailable
    logical_cpus: int | Unavailable
    physical_cores: int | Unavailable
    smt_active: bool | Unavailable
    smt_control: str | Unavailable      # on, off, forceoff, notsupported, notimplemented
    virtual_machine: bool               # the `hypervisor` cpuinfo flag
    scaling_driver: str | Unavailable   # amd-pstate-epp, intel_pstate, acpi-cpufreq, ...
    governor: str | Unavailable         # cpu0's, or "mixed: ..." when CPUs differ
    energy_perf_preference: str | Unavailable
    boost: bool | Unavailable
    cur_mhz: float | Unavailable        # median over CPUs, now
    max_mhz: float | Unavailable        # the highest cpuinfo_max_freq


def probe_cpu(root: str | Path = "/", run: Runner = run_command) -> CpuInfo:
    fs = Fs(root)
    blocks = _cpuinfo_blocks(fs)
    first = blocks[0] if isinstance(blocks, list) and blocks else {}
    vm = "hypervisor" in first.get("flags", "").split()
    no_freq = _no_cpufreq_reason(fs, vm)
    smt_control = fs.read(f"{CPU}/smt/control")
    smt_active = fs.read_int(f"{CPU}/smt/active")
    return CpuInfo(
        model=_model(first, blocks, run),
        vendor=first.get("vendor_id") or first.get("CPU implementer") or Unavailable(
            "no vendor_id in /proc/cpuinfo"),
        logical_cpus=len(blocks) if isinstance(blocks, list) and blocks else Unavailable(
            "no processors listed in /proc/cpuinfo"),
        physical_cores=_physical_cores(fs, blocks),
        smt_active=bool(smt_active) if isinstance(smt_active, int) else smt_active,
        smt_control=smt_control,
        virtual_machine=vm,
        scaling_driver=no_freq or fs.read(f"{CPU}/cpu0/cpufreq/scaling_driver"),
        governor=no_freq or _governor(fs),
        energy_perf_preference=no_freq or fs.read(
            f"{CPU}/cpu0/cpufreq/energy_performance_preference"),
        boost=_boost(fs),
        cur_mhz=read_cpu_mhz(root),
        max_mhz=no_freq or _max_mhz(fs),
    )


def read_cpu_mhz(root: str | Path = "/") -> float | Unavailable:
    """Median current clock over all CPUs: cpufreq's scaling_cur_freq, else /proc/cpuinfo."""
    fs = Fs(root)
    khz = [fs.read_int(p) for p in fs.glob(f"{CPU}/cpu[0-9]*/cpufreq/scaling_cur_freq")]
    khz = [k for k in khz if isinstance(k, int)]
    if khz:
        return statistics.median(khz) / 1000.0
    blocks = _cpuinfo_blocks(fs)
    if isinstance(blocks, Unavailable):
        return blocks
    mhz = [float(b["cpu MHz"]) for b in blocks if _is_float(b.get("cpu MHz"))]
    if mhz:
        return statistics.median(mhz)
    return Unavailable("no cpufreq scaling_cur_freq and no 'cpu MHz' in /proc/cpuinfo")


def _cpuinfo_blocks(fs: Fs) -> list[dict[str, str]] | Unavailable:
    text = fs.read("/proc/cpuinfo")
    if isinstance(text, Unavailable):
        return text
    blocks = [key_values(b) for b in text.split("\n\n") if b.strip()]
    return [b for b in blocks if "processor" in b]


def _model(first: dict[str, str], blocks, run: Runner) -> str | Unavailable:
    for key in ("model name", "Model Name", "cpu model", "Hardware"):
        if first.get(key):
            return first[key]
    out = run(["lscpu"])  # arm64 /proc/cpuinfo names no model; lscpu decodes the part number
    if isinstance(out, str):
        name = key_values(out).get("Model name")
        if name:
            return name
    if isinstance(blocks, Unavailable):
        return blocks
    return Unavailable("no model name in /proc/cpuinfo or lscpu")


def _physical_cores(fs: Fs, blocks) -> int | Unavailable:
    ids = {(b.get("physical id"), b.get("core id")) for b in blocks or [] if "core id" in b} \
        if isinstance(blocks, list) else set()
    if ids:
        return len(ids)
    topo = {(fs.read(f"{d}/topology/physical_package_id"), fs.read(f"{d}/topology/core_id"))
            for d in fs.glob(f"{CPU}/cpu[0-9]*")}
    topo = {t for t in topo if all(isinstance(x, str) for x in t)}
    if topo:
        return len(topo)
    return Unavailable("no core ids in /proc/cpuinfo or cpu topology in sysfs")


def _no_cpufreq_reason(fs: Fs, vm: bool) -> Unavailable | None:
    if fs.exists(f"{CPU}/cpu0/cpufreq"):
        return None
    why = "usual in a virtual machine" if vm else "no cpufreq driver is loaded"
    return Unavailable(f"no {CPU}/cpu0/cpufreq: {why}")


def _governor(fs: Fs) -> str | Unavailable:
    govs = [fs.read(p) for p in fs.glob(f"{CPU}/cpu[0-9]*/cpufreq/scaling_governor")]
    govs = [g for g in govs if isinstance(g, str)]
    if not govs:
        return fs.read(f"{CPU}/cpu0/cpufreq/scaling_governor")
    counts = Counter(govs)
    if len(counts) == 1:
        return govs[0]
    return "mixed: " + ", ".join(f"{g} x{n}" for g, n in counts.most_common())


def _boost(fs: Fs) -> bool | Unavailable:
    for p in (f"{CPU}/cpufreq/boost", f"{CPU}/intel_pstate/no_turbo"):
        v = fs.read_int(p)
        if isinstance(v, int):
            return bool(v) if p.endswith("boost") else not v
    return Unavailable(f"no {CPU}/cpufreq/boost or intel_pstate/no_turbo")


def _max_mhz(fs: Fs) -> float | Unavailable:
    khz = [fs.read_int(p) for p in fs.glob(f"{CPU}/cpu[0-9]*/cpufreq/cpuinfo_max_freq")]
    khz = [k for k in khz if isinstance(k, int)]
    if khz:
        return max(khz) / 1000.0
    v = fs.read_int(f"{CPU}/cpu0/cpufreq/cpuinfo_max_freq")
    return v / 1000.0 if isinstance(v, int) else v


def _is_float(s: str | None) -> bool:
    try:
        float(s)  # type: ignore[arg-type]
        return True
    except (TypeError, ValueError):
        return False
