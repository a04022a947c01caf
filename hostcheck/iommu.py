"""IOMMU mode: off, passthrough (identity domains) or translated (DMA domains), and where from.

The groups' `type` files are the truth for a running kernel: `identity` is passthrough
(`iommu=pt`, or a kernel built with passthrough as its default), `DMA` / `DMA-FQ` translate
every device access. No IOMMU units and no groups means off. The kernel command line is only
the fallback when sysfs does not say. On an APU passthrough costs prefill (seed 003: 13-16%),
so the GPU's own group is preferred over a count of all groups.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .facts import Fs, Runner, Unavailable, run_command
from .kernel import cmdline_params

GROUPS = "/sys/kernel/iommu_groups"
UNITS = "/sys/class/iommu"
CMDLINE_KEYS = ("iommu", "amd_iommu", "intel_iommu", "iommu.passthrough", "iommu.strict")
_MODE_OF_TYPE = {"identity": "passthrough", "DMA": "translated", "DMA-FQ": "translated"}


@dataclass(frozen=True)
class IommuInfo:
    mode: str | Unavailable          # off, passthrough, translated or mixed
    source: str                      # where the mode was read
    units: tuple[str, ...] | Unavailable   # /sys/class/iommu entries (ivhd0, dmar0, ...)
    group_types: dict[str, int] = field(default_factory=dict)  # type -> number of groups
    gpu_group_type: str | None = None      # the display device's group type, when found
    cmdline: dict[str, str] = field(default_factory=dict)      # IOMMU parameters given at boot


def probe_iommu(root: str | Path = "/", run: Runner = run_command) -> IommuInfo:
    fs = Fs(root)
    cmdline = fs.read("/proc/cmdline")
    params = cmdline_params(cmdline) if isinstance(cmdline, str) else {}
    boot = {k: params[k] for k in CMDLINE_KEYS if k in params}
    units = fs.listdir(UNITS)
    units = tuple(units) if isinstance(units, list) else units
    groups = fs.listdir(GROUPS)

    if isinstance(groups, list) and groups:
        types = {g: fs.read(f"{GROUPS}/{g}/type") for g in groups}
        counts = Counter(t for t in types.values() if isinstance(t, str))
        gpu_group, gpu_type = _display_group(fs, types)
        if gpu_type in _MODE_OF_TYPE:
            mode, source = _MODE_OF_TYPE[gpu_type], f"{GROUPS}/{gpu_group}/type, the GPU's group"
        else:
            mode = _mode_of_counts(counts)
            source = f"{GROUPS}/*/type ({len(groups)} groups)"
        return IommuInfo(mode, source, units, dict(counts), gpu_type, boot)

    if isinstance(groups, list) or (isinstance(units, tuple) and not units):
        off_flag = _cmdline_mode(boot)
        source = f"{UNITS} and {GROUPS} list nothing"
        if off_flag == "off":
            source += " (and the kernel command line turns it off)"
        return IommuInfo("off", source, units, {}, None, boot)

    mode = _cmdline_mode(boot)
    if mode is None:
        why = f"no {GROUPS} and no IOMMU setting on the kernel command line"
        return IommuInfo(Unavailable(why), "nothing readable", units, {}, None, boot)
    return IommuInfo(mode, "kernel command line (" + " ".join(
        f"{k}={v}" for k, v in boot.items()) + ")", units, {}, None, boot)


def _display_group(fs: Fs, types: dict[str, object]) -> tuple[str | None, str | None]:
    """The group holding a PCI display controller (class 0x03xxxx) and its type."""
    for group, gtype in types.items():
        devices = fs.listdir(f"{GROUPS}/{group}/devices")
        for dev in devices if isinstance(devices, list) else []:
            cls = fs.read(f"/sys/bus/pci/devices/{dev}/class")
            if isinstance(cls, str) and cls.lower().startswith("0x03") and isinstance(gtype, str):
                return group, gtype
    return None, None


def _mode_of_counts(counts: Counter) -> str | Unavailable:
    modes = {_MODE_OF_TYPE[t] for t in counts if t in _MODE_OF_TYPE}
    if len(modes) == 1:
        return modes.pop()
    if modes:
        return "mixed"
    if counts:  # only blocked / unmanaged (devices handed to VFIO): no DMA domain to judge by
        return Unavailable("groups are only " + ", ".join(sorted(counts)))
    return Unavailable(f"no readable {GROUPS}/*/type")


def _cmdline_mode(boot: dict[str, str]) -> str | None:
    if "off" in (boot.get("amd_iommu"), boot.get("intel_iommu"), boot.get("iommu")):
        return "off"
    if boot.get("iommu") == "pt" or boot.get("iommu.passthrough") in ("1", "on", "y"):
        return "passthrough"
    if boot.get("iommu.passthrough") in ("0", "off", "n") or boot.get("intel_iommu") == "on":
        return "translated"
    return None
