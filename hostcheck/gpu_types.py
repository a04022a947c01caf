"""The GPU records: one `GpuInfo` per device, the GTT limits, and the `GpuReport` holding both."""
from __future__ import annotations

from dataclasses import dataclass, field

from .facts import Unavailable
from .vulkan import VulkanDevice


@dataclass(frozen=True)
class GpuInfo:
    vendor: str                          # AMD, NVIDIA, Intel, or the PCI vendor id
    name: str | Unavailable
    arch: str | Unavailable              # gfx1151, sm_89 (Ada), ...
    pci_slot: str | Unavailable          # 0000:c5:00.0
    driver: str | Unavailable            # "amdgpu (in-tree, kernel 6.17.0)", "nvidia 580.95.05"
    runtime: str | Unavailable           # "ROCm 7.14.0", "CUDA 13.0 (the driver's)"
    vram_bytes: int | Unavailable        # dedicated (or BIOS carve-out on an APU)
    gtt_bytes: int | Unavailable         # GPU-mappable system memory (amdgpu)
    unified: bool | Unavailable          # shares the host's memory (APU, GB10)
    cur_mhz: float | Unavailable         # shader clock now
    max_mhz: float | Unavailable         # its top state
    source: str                          # where these facts were read


@dataclass(frozen=True)
class GttLimits:
    """What caps amdgpu's GTT: ttm's page limit and amdgpu.gttsize, as loaded and as booted."""

    ttm_pages_limit: int | Unavailable   # in 4 KiB pages
    amdgpu_gttsize_mib: int | Unavailable  # -1 means the driver's default
    cmdline: dict[str, str] = field(default_factory=dict)  # amdgpu.gttsize, ttm.* as booted

    @property
    def ttm_limit_bytes(self) -> int | None:
        return self.ttm_pages_limit * 4096 if isinstance(self.ttm_pages_limit, int) else None


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[GpuInfo, ...]
    gtt_limits: GttLimits | Unavailable  # Unavailable unless amdgpu is loaded
    not_found: tuple[str, ...] = ()      # why each source found nothing
    # every device the Vulkan loader lists, software ones included (hostcheck.vulkan)
    vulkan: tuple[VulkanDevice, ...] | Unavailable = Unavailable("not probed")
