"""GPUs: every PCI display device under /sys/class/drm, detailed by its vendor's probe.

AMD devices are read from amdgpu's sysfs; NVIDIA devices from `nvidia-smi` (sysfs says little
about them). A device that its vendor's probe cannot detail is still listed, with the reason.
"""
from __future__ import annotations

import re
from pathlib import Path

from .facts import Fs, Runner, Unavailable, cached, run_command
from .gpu_amd import gtt_limits, probe_amd_card, uevent_of
from .gpu_nvidia import driver_from_proc, probe_nvidia
from .gpu_types import GpuInfo, GpuReport, GttLimits
from .vulkan import probe_vulkan

VENDORS = {"0x1002": "AMD", "0x10de": "NVIDIA", "0x8086": "Intel"}


def probe_gpus(root: str | Path = "/", run: Runner = run_command) -> GpuReport:
    fs, run = Fs(root), cached(run)
    gpus: list[GpuInfo] = []
    not_found: list[str] = []
    cards = _drm_cards(fs)
    if not cards:
        not_found.append("no display devices under /sys/class/drm")
    for dev, uevent, vendor in cards:
        if vendor == "0x1002":
            gpus.append(probe_amd_card(fs, run, dev, uevent))
    nvidia = probe_nvidia(fs, run)
    if isinstance(nvidia, list):
        gpus.extend(nvidia)
    else:
        not_found.append(f"NVIDIA: {nvidia.reason}")
    listed = {g.pci_slot for g in gpus}
    for dev, uevent, vendor in cards:
        if vendor != "0x1002" and uevent.get("PCI_SLOT_NAME") not in listed:
            why = nvidia.reason if isinstance(nvidia, Unavailable) and vendor == "0x10de" else None
            gpus.append(_bare(fs, dev, uevent, vendor, why))
    amd_loaded = fs.exists("/sys/module/amdgpu") or any(g.vendor == "AMD" for g in gpus)
    limits: GttLimits | Unavailable = gtt_limits(fs) if amd_loaded else Unavailable(
        "amdgpu is not loaded")
    # the loader reads the live host only: below a fixture root there is nothing to ask
    vulkan = probe_vulkan() if Path(root) == Path("/") else Unavailable(f"the Vulkan loader is not read below {root}")
    return GpuReport(gpus=tuple(gpus), gtt_limits=limits, not_found=tuple(not_found), vulkan=vulkan)


def _drm_cards(fs: Fs) -> list[tuple[str, dict[str, str], str]]:
    """(device dir, its uevent, PCI vendor id) per PCI display device, one per PCI slot."""
    out, seen = [], set()
    for card in fs.glob("/sys/class/drm/card*"):
        if not re.fullmatch(r"card\d+", card.rsplit("/", 1)[-1]):
            continue  # card0-DP-1 and friends are connectors, not devices
        dev = f"{card}/device"
        vendor = fs.read(f"{dev}/vendor")
        uevent = uevent_of(fs, dev)
        slot = uevent.get("PCI_SLOT_NAME", card)
        if isinstance(vendor, str) and slot not in seen:
            seen.add(slot)
            out.append((dev, uevent, vendor.lower()))
    return out


def _bare(fs: Fs, dev: str, uevent: dict[str, str], vendor: str, why: str | None) -> GpuInfo:
    """A device known only from sysfs: vendor, slot and driver; the rest unavailable."""
    reason = why or f"no probe for {VENDORS.get(vendor, vendor)} GPUs beyond sysfs"
    na = Unavailable(reason)
    driver: str | Unavailable = uevent.get("DRIVER") or Unavailable(f"no driver bound to {dev}")
    if vendor == "0x10de":
        driver = driver_from_proc(fs) if fs.exists("/proc/driver/nvidia/version") else driver
    return GpuInfo(vendor=VENDORS.get(vendor, vendor), name=na, arch=na,
                   pci_slot=uevent.get("PCI_SLOT_NAME") or Unavailable(f"no slot in {dev}/uevent"),
                   driver=driver, runtime=na, vram_bytes=na, gtt_bytes=na, unified=na,
                   cur_mhz=na, max_mhz=na, source=dev.rsplit("/device", 1)[0])
