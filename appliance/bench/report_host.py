"""The host conditions in a run's report: this machine's snapshot as hostcheck stored it, and
each RPC worker's (issue 52), so a figure measured over a split names every machine's."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .results import GIB


def _fact(d: Any, key: str, show: Callable[[Any], str] = str) -> str:
    """A snapshot fact as hostcheck stores it: the value, or {"unavailable": reason}."""
    value = d.get(key) if isinstance(d, Mapping) else None
    if value is None:
        return "unavailable"
    if isinstance(value, Mapping) and "unavailable" in value:
        return f"unavailable ({value['unavailable']})"
    return show(value)


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def _watts(w: float) -> str:
    return f"{w:.0f} W"


def _power(power: Mapping[str, Any]) -> list[str]:
    lines = [f"- power {d.get('label', '?')} ({d.get('kind', '?')}): limit "
             f"{_fact(d, 'cap_w', _watts)}, default {_fact(d, 'default_cap_w', _watts)}, min "
             f"{_fact(d, 'min_cap_w', _watts)}, max {_fact(d, 'max_cap_w', _watts)}"
             for d in power.get("domains", [])]
    why = "; ".join(power.get("not_found", [])) or "not in the snapshot"
    return lines or [f"- power limits: unavailable ({why})"]


def _gpus(gpu: Mapping[str, Any]) -> list[str]:
    lines = [f"- GPU: {g.get('vendor', '?')} {_fact(g, 'name')}, arch {_fact(g, 'arch')}, "
             f"{_fact(g, 'unified', lambda u: 'unified memory' if u else 'dedicated VRAM')}, "
             f"VRAM {_fact(g, 'vram_bytes', _gib)}, GTT {_fact(g, 'gtt_bytes', _gib)}, "
             f"driver {_fact(g, 'driver')}, runtime {_fact(g, 'runtime')}"
             for g in gpu.get("gpus", [])]
    why = "; ".join(gpu.get("not_found", [])) or "not in the snapshot"
    return lines or [f"- GPU: unavailable ({why})"]


def host_lines(s: Mapping[str, Any] | None) -> list[str]:
    """The conditions of the host a run measured on, and of every RPC worker it held layers on."""
    if s is None:
        return ["- host: unavailable (no snapshot stored with this run)"]
    return _machine(s) + [line for ep, facts in (s.get("workers") or {}).items() for line in _worker(ep, facts)]


def _worker(endpoint: str, facts: Mapping[str, Any]) -> list[str]:
    """A worker's facts as its own `hostcheck --json` gave them (worker_facts.py), indented."""
    if not isinstance(facts.get("snapshot"), Mapping):
        return [f"- RPC worker {endpoint}: facts unavailable ({facts.get('error', 'not stored')})"]
    offers = ", ".join(f"{d.get('name')} {d.get('total', 0) / GIB:.1f} GiB" for d in (facts.get("worker") or {}).get("offers", []))
    return [f"- RPC worker {endpoint}" + (f", offering {offers}" if offers else "") + ":"] + \
        ["  " + line for line in _machine(facts["snapshot"])]


def _machine(s: Mapping[str, Any]) -> list[str]:
    cpu, mem, kernel, iommu = (s.get(k, {}) for k in ("cpu", "memory", "kernel", "iommu"))
    cmdline = _fact(kernel, "cmdline", lambda c: f"`{c}`")
    lines = [f"- host snapshot: {_fact(s, 'taken_at')}",
             f"- CPU: {_fact(cpu, 'model')}, {_fact(cpu, 'physical_cores')} cores / "
             f"{_fact(cpu, 'logical_cpus')} threads, governor {_fact(cpu, 'governor')}, "
             f"driver {_fact(cpu, 'scaling_driver')}, boost "
             f"{_fact(cpu, 'boost', lambda b: 'on' if b else 'off')}, max "
             f"{_fact(cpu, 'max_mhz', lambda v: f'{v:.0f} MHz')}"
             + (", virtual machine" if cpu.get("virtual_machine") else ""),
             f"- memory: {_fact(mem, 'total_bytes', _gib)}, transparent huge pages "
             f"{_fact(mem, 'thp_enabled')}",
             f"- kernel: {_fact(kernel, 'release')} on {_fact(kernel, 'distribution')}",
             f"- kernel command line: {cmdline}",
             f"- IOMMU: {_fact(iommu, 'mode')}"]
    return lines + _power(s.get("power", {})) + _gpus(s.get("gpu", {}))
