"""The readable host report and its JSON form. Printing only: every fact comes from a snapshot."""
from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from .advice import Advice, LlamaBuild
from .facts import Unavailable, known, to_jsonable
from .gpu_types import GpuInfo, GttLimits
from .power import PowerDomain
from .snapshot import HostSnapshot
from .vulkan import VulkanDevice

GIB = 2**30
WIDTH = 100


def as_json(snap: HostSnapshot, advice: list[Advice], llama: LlamaBuild | None = None) -> dict[str, Any]:
    out = {"snapshot": snap.to_dict(), "advice": to_jsonable(advice),
           "unavailable": dict(snap.unavailable())}
    if llama is not None:
        out["llama_cpp"] = to_jsonable(llama)
    return out


def render(snap: HostSnapshot, advice: list[Advice], llama: LlamaBuild | None = None) -> str:
    lines = [f"Host conditions (hostcheck, {snap.taken_at})", ""]
    for title, section in (("CPU", _cpu), ("Memory", _memory), ("Kernel", _kernel),
                           ("IOMMU", _iommu), ("GPU", _gpu), ("Power", _power)):
        rows = section(snap)
        lines.append(f"{title:<8} {rows[0]}")
        lines += [f"{'':<8} {r}" for r in rows[1:]]
    if llama is not None:
        lines += _llama(llama)
    lines.append("")
    lines += _advice(advice)
    n = len(snap.unavailable())
    if n:
        lines += ["", f"{n} facts unavailable on this host; --json lists each with its reason "
                      "under \"unavailable\"."]
    return "\n".join(_wrap(line) for line in lines) + "\n"


def _llama(llama: LlamaBuild) -> list[str]:
    """The installed llama.cpp's devices, as its registry reports them."""
    head = f"llama.cpp {llama.version}, {'GPU offload' if llama.gpu_offload else 'no GPU backend (CPU only)'}"
    rows = [f"{d.name} ({d.description}): {d.free_bytes / GIB:.1f} GiB free of {d.total_bytes / GIB:.1f} GiB"
            + _memory_kind(d.kind, d.host_memory) for d in llama.devices]
    return [f"{'llama':<8} {head}"] + [f"{'':<8} {r}" for r in rows]


def _memory_kind(kind: str, host_memory: bool) -> str:
    """Whose memory a llama.cpp GPU holds, as the fit planner counts it."""
    if kind == "igpu":
        return "; integrated GPU: host memory, planned as unified"
    if kind == "gpu" and host_memory:
        return ("; host memory (a software device on the CPU, which llama.cpp calls a discrete GPU, uma: 0): "
                "planned as unified")
    return "; its own memory" if kind == "gpu" else ""


def fmt(value: Any, show: Callable[[Any], str] = str) -> str:
    return str(value) if isinstance(value, Unavailable) else show(value)


def _gib(b: int) -> str:
    return f"{b / GIB:.1f} GiB"


def _mhz(v: float) -> str:
    return f"{v:.0f} MHz"


def _watts(v: float) -> str:
    return f"{v:.1f} W"


def _cpu(s: HostSnapshot) -> list[str]:
    c = s.cpu
    smt = fmt(c.smt_active, lambda a: "on" if a else "off")
    if isinstance(c.smt_control, str) and c.smt_control not in ("on", "off"):
        smt += f" ({c.smt_control})"
    head = (f"{fmt(c.model)} ({fmt(c.vendor)}): {fmt(c.logical_cpus)} logical CPUs, "
            f"{fmt(c.physical_cores)} cores, SMT {smt}"
            + (", virtual machine" if c.virtual_machine else ""))
    boost = f"boost {fmt(c.boost, lambda b: 'on' if b else 'off')}"
    clock = f"clock {fmt(c.cur_mhz, _mhz)} now (median over CPUs)"
    scaling = (c.governor, c.scaling_driver, c.energy_perf_preference, c.max_mhz)
    if all(isinstance(v, Unavailable) for v in scaling) and len(set(scaling)) == 1:
        # one cause (no cpufreq at all): say it once
        return [head, f"governor, driver, energy/performance preference and max clock {c.governor}",
                f"{clock}; {boost}"]
    return [head,
            f"governor {fmt(c.governor)}, driver {fmt(c.scaling_driver)}, "
            f"energy/performance preference {fmt(c.energy_perf_preference)}",
            f"{clock}, max {fmt(c.max_mhz, _mhz)}; {boost}"]


def _memory(s: HostSnapshot) -> list[str]:
    m = s.memory
    return [f"{fmt(m.total_bytes, _gib)} total, {fmt(m.available_bytes, _gib)} available",
            f"transparent huge pages {fmt(m.thp_enabled)} (defrag {fmt(m.thp_defrag)})"]


def _kernel(s: HostSnapshot) -> list[str]:
    k = s.kernel
    return [f"{fmt(k.release)} on {fmt(k.distribution)}", f"command line: {fmt(k.cmdline)}"]


def _iommu(s: HostSnapshot) -> list[str]:
    i = s.iommu
    rows = [f"{fmt(i.mode)}, read from {i.source}"]
    if s.cpu.virtual_machine:
        rows.append("inside a virtual machine: this is the guest's view, not the host's IOMMU")
    units = fmt(i.units, lambda u: ", ".join(u) or "none")
    groups = ", ".join(f"{t} x{n}" for t, n in i.group_types.items()) or "none"
    rows.append(f"units: {units}; group types: {groups}")
    if i.cmdline:
        rows.append("booted with " + " ".join(f"{k}={v}" if v else k for k, v in i.cmdline.items()))
    return rows


def _gpu(s: HostSnapshot) -> list[str]:
    rows: list[str] = []
    for g in s.gpu.gpus:
        rows += _one_gpu(g)
    if not rows:
        rows.append("none found: " + "; ".join(s.gpu.not_found))
    if isinstance(s.gpu.vulkan, tuple):
        rows += [_vulkan(v) for v in s.gpu.vulkan] or ["Vulkan: the loader lists no device"]
    else:
        rows.append(f"Vulkan: {s.gpu.vulkan}")
    if isinstance(s.gpu.gtt_limits, GttLimits):
        rows.append(_gtt(s.gpu.gtt_limits))
    return rows


def _one_gpu(g: GpuInfo) -> list[str]:
    unified = fmt(g.unified, lambda u: "unified memory (APU)" if u else "dedicated VRAM")
    if isinstance(g.name, Unavailable):
        name = f"{g.vendor} GPU (name {g.name})"
    else:
        name = g.name if g.name.startswith(g.vendor) else f"{g.vendor} {g.name}"
    return [f"{name} at {fmt(g.pci_slot)}, arch {fmt(g.arch)}, {unified}",
            f"  driver {fmt(g.driver)}; runtime {fmt(g.runtime)}",
            f"  VRAM {fmt(g.vram_bytes, _gib)}; GTT {fmt(g.gtt_bytes, _gib)}",
            f"  clock {fmt(g.cur_mhz, _mhz)} now, max {fmt(g.max_mhz, _mhz)} (from {g.source})"]


def _vulkan(v: VulkanDevice) -> str:
    what = {"cpu": "CPU-type: software on the host's cores, its memory host memory",
            "integrated": "integrated GPU: host memory"}.get(v.type, f"{v.type} GPU")
    return (f"Vulkan: {v.name} ({what}), API {v.api_version}, device-local heaps "
            f"{_gib(v.device_local_bytes)}")


def _gtt(t: GttLimits) -> str:
    ttm = fmt(t.ttm_pages_limit, lambda p: f"{p} pages = {_gib(p * 4096)}")
    gtt = fmt(t.amdgpu_gttsize_mib, lambda m: "driver default" if m < 0 else f"{m} MiB")
    booted = " ".join(f"{k}={v}" for k, v in t.cmdline.items()) or "none"
    return f"GTT limits: ttm.pages_limit {ttm}; amdgpu.gttsize {gtt}; on the command line: {booted}"


def _allowed(d: PowerDomain) -> str:
    """The range a cap may be set in: min..max where both are known, else what is."""
    if known(d.min_cap_w) and known(d.max_cap_w):
        return f"{_watts(d.min_cap_w)}..{_watts(d.max_cap_w)}"
    return f"min {fmt(d.min_cap_w, _watts)}, max {fmt(d.max_cap_w, _watts)}"


def _power(s: HostSnapshot) -> list[str]:
    rows = []
    for d in s.power.domains:
        rows.append(f"{d.label} ({d.kind}, {d.path}): {fmt(d.power_w, _watts)} now; "
                    f"cap {fmt(d.cap_w, _watts)}, default {fmt(d.default_cap_w, _watts)}, "
                    f"allowed {_allowed(d)}")
    if not rows:
        rows.append("none readable: " + "; ".join(s.power.not_found))
    return rows


def _advice(advice: list[Advice]) -> list[str]:
    if not advice:
        return ["Warnings: none (for the settings hostcheck knows to cost performance)."]
    lines = [f"Warnings ({sum(a.severity == 'warning' for a in advice)}) and notes "
             f"({sum(a.severity == 'note' for a in advice)}):"]
    for a in advice:
        mark = "WARNING" if a.severity == "warning" else "note"
        lines += [f"  {mark}: {a.setting}: {a.message}", f"    fix: {a.fix}"]
    return lines


def _wrap(line: str) -> str:
    """Wrap long rows under their own text: a section's first row starts at column 0, but its
    text (like its other rows') starts at column 9."""
    if len(line) <= WIDTH:
        return line
    lead = len(line) - len(line.lstrip())
    indent = " " * ((lead or 9) + 4)
    return textwrap.fill(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)
