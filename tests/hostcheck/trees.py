"""Fixture hosts built in tmp_path from dicts: a Strix Halo-like APU, an NVIDIA desktop, a bare VM.

A tree maps paths to file contents; a path ending in "/" is an empty directory and a `Link`
is a symlink (as /sys/class/hwmon/hwmonN is to the device's hwmon directory). Each host comes
with a fake command runner, the way the probes meet nvidia-smi and rocminfo.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hostcheck.facts import Unavailable


@dataclass(frozen=True)
class Link:
    target: str  # absolute, as seen from the fixture's root


Tree = dict[str, "str | Link"]
THP_DEFRAG = "always defer defer+madvise [madvise] never\n"


def build(root: Path, tree: Tree) -> Path:
    for path, content in tree.items():
        dest = root / path.lstrip("/")
        if path.endswith("/"):
            dest.mkdir(parents=True, exist_ok=True)
        elif isinstance(content, Link):
            dest.parent.mkdir(parents=True, exist_ok=True)
            target = root / content.target.lstrip("/")
            dest.symlink_to(os.path.relpath(target, dest.parent))
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(content)
    return root


class FakeRunner:
    """argv[0] -> output (a string, or a function of argv); anything else is 'not found'."""

    def __init__(self, tools: dict | None = None):
        self.tools = tools or {}
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> str | Unavailable:
        self.calls.append(tuple(argv))
        tool = self.tools.get(argv[0])
        if tool is None:
            return Unavailable(f"{argv[0]} not found on PATH")
        return tool(argv) if callable(tool) else tool


def cpuinfo(model: str, cores: list[tuple[int, int]], mhz: float, vendor: str,
            flags: str) -> str:
    """One /proc/cpuinfo block per (physical id, core id), in processor order."""
    per_core: dict[tuple[int, int], int] = {}
    for c in cores:
        per_core[c] = per_core.get(c, 0) + 1
    blocks = []
    for i, (pkg, core) in enumerate(cores):
        blocks.append(f"processor\t: {i}\nvendor_id\t: {vendor}\nmodel name\t: {model}\n"
                      f"cpu MHz\t\t: {mhz:.3f}\nphysical id\t: {pkg}\nsiblings\t: {len(cores)}\n"
                      f"core id\t\t: {core}\ncpu cores\t: {len(per_core)}\nflags\t\t: {flags}\n")
    return "\n".join(blocks) + "\n"


def cpufreq(n: int, governor: str, driver: str, epp: str, cur_khz: list[int],
            max_khz: int) -> Tree:
    tree: Tree = {}
    for i in range(n):
        d = f"/sys/devices/system/cpu/cpu{i}/cpufreq"
        tree |= {f"{d}/scaling_governor": governor, f"{d}/scaling_driver": driver,
                 f"{d}/energy_performance_preference": epp,
                 f"{d}/scaling_cur_freq": str(cur_khz[i % len(cur_khz)]),
                 f"{d}/cpuinfo_max_freq": str(max_khz)}
    return tree


# -- Strix Halo-like APU: Ryzen AI Max+ 395, Radeon 8060S (gfx1151), 128 GB unified ----------

APU_SLOT = "0000:c5:00.0"
APU_DEV = "/sys/class/drm/card1/device"
APU_HWMON = f"{APU_DEV}/hwmon/hwmon5"
APU_CMDLINE = ("BOOT_IMAGE=/boot/vmlinuz-6.17.0-5-generic root=UUID=0f3c ro quiet splash "
               "iommu=pt amdgpu.gttsize=65536 ttm.pages_limit=16777216")


def strix_halo() -> Tree:
    cores = [(0, c) for c in range(16)] * 2  # 16 cores, SMT on: 32 threads
    flags = "fpu vme de pse tsc msr avx2 avx512f"
    return {
        "/proc/cpuinfo": cpuinfo("AMD RYZEN AI MAX+ 395 w/ Radeon 8060S", cores, 3000.0,
                                 "AuthenticAMD", flags),
        "/proc/meminfo": "MemTotal:       133693440 kB\nMemFree:        120000000 kB\n"
                         "MemAvailable:   125829120 kB\n",
        "/proc/cmdline": APU_CMDLINE + "\n",
        "/proc/sys/kernel/osrelease": "6.17.0-5-generic\n",
        "/etc/os-release": 'NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu\n',
        "/sys/devices/system/cpu/smt/control": "on\n",
        "/sys/devices/system/cpu/smt/active": "1\n",
        "/sys/devices/system/cpu/cpufreq/boost": "1\n",
        **cpufreq(32, "powersave", "amd-pstate-epp", "balance_power",
                  [3000000, 1200000, 3100000, 2900000], 5187000),
        "/sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never\n",
        "/sys/kernel/mm/transparent_hugepage/defrag": THP_DEFRAG,
        # the GPU: amdgpu sysfs, a connector that is not a device, KFD topology
        f"{APU_DEV}/vendor": "0x1002\n",
        f"{APU_DEV}/device": "0x1586\n",
        f"{APU_DEV}/uevent": f"DRIVER=amdgpu\nPCI_CLASS=38000\nPCI_ID=1002:1586\n"
                             f"PCI_SLOT_NAME={APU_SLOT}\n",
        f"{APU_DEV}/mem_info_vram_total": str(512 * 2**20),
        f"{APU_DEV}/mem_info_gtt_total": str(64 * 2**30),
        f"{APU_DEV}/pp_dpm_sclk": "0: 600Mhz \n1: 1200Mhz *\n2: 2900Mhz \n",
        f"{APU_HWMON}/name": "amdgpu\n",
        f"{APU_HWMON}/power1_input": "69000000\n",
        f"{APU_HWMON}/power1_cap": "70000000\n",
        f"{APU_HWMON}/power1_cap_default": "120000000\n",
        f"{APU_HWMON}/power1_cap_max": "140000000\n",
        f"{APU_HWMON}/freq1_input": "2229000000\n",
        f"{APU_HWMON}/freq1_label": "sclk\n",
        "/sys/class/drm/card1-eDP-1/status": "connected\n",
        "/sys/class/hwmon/hwmon5": Link(APU_HWMON),
        "/sys/class/hwmon/hwmon2/name": "k10temp\n",
        "/sys/class/hwmon/hwmon2/temp1_input": "45000\n",
        "/sys/class/kfd/kfd/topology/nodes/0/properties":
            "cpu_cores_count 32\nsimd_count 0\ngfx_target_version 0\nlocation_id 0\ndomain 0\n",
        "/sys/class/kfd/kfd/topology/nodes/1/properties":
            "cpu_cores_count 0\nsimd_count 80\nvendor_id 4098\ndevice_id 5510\n"
            "location_id 50432\ndomain 0\ndrm_render_minor 128\ngfx_target_version 110501\n",
        "/sys/module/amdgpu/parameters/gttsize": "65536\n",
        "/sys/module/ttm/parameters/pages_limit": "16777216\n",
        "/opt/rocm/.info/version": "6.4.1-120\n",
        # IOMMU in passthrough: identity domains, the GPU in group 2
        "/sys/class/iommu/ivhd0/uevent": "\n",
        "/sys/kernel/iommu_groups/0/type": "identity\n",
        "/sys/kernel/iommu_groups/1/type": "identity\n",
        "/sys/kernel/iommu_groups/2/type": "identity\n",
        f"/sys/kernel/iommu_groups/2/devices/{APU_SLOT}/": "",
        f"/sys/bus/pci/devices/{APU_SLOT}/class": "0x038000\n",
        "/sys/kernel/iommu_groups/3/type": "identity\n",
        "/sys/kernel/iommu_groups/3/devices/0000:c4:00.0/": "",
        "/sys/bus/pci/devices/0000:c4:00.0/class": "0x010802\n",
        # RAPL: the control type, the package zone (no limits on AMD) and a core subzone
        "/sys/class/powercap/intel-rapl/enabled": "1\n",
        "/sys/class/powercap/intel-rapl:0/name": "package-0\n",
        "/sys/class/powercap/intel-rapl:0/energy_uj": "1000000\n",
        "/sys/class/powercap/intel-rapl:0/max_energy_range_uj": "65532610987\n",
        "/sys/class/powercap/intel-rapl:0:0/name": "core\n",
        "/sys/class/powercap/intel-rapl:0:0/energy_uj": "500000\n",
    }


def strix_halo_runner() -> FakeRunner:
    return FakeRunner()  # no rocminfo, no nvidia-smi: sysfs must be enough


# -- NVIDIA desktop: i9-13900K (8 P-cores with HT + 16 E-cores), RTX 4090 ---------------------

NV_SLOT = "0000:01:00.0"
NV_GPU_ROW = "0, NVIDIA GeForce RTX 4090, 00000000:01:00.0, 570.133.07, 24564, 8.9, 2520, 3105\n"
NV_POWER_ROW = "0, 285.40, 450.00, 450.00, 600.00, 150.00\n"
NV_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.133.07             Driver Version: 570.133.07     CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
"""


def nvidia_desktop() -> Tree:
    cores = [(0, c) for c in range(8)] * 2 + [(0, c) for c in range(8, 24)]
    return {
        "/proc/cpuinfo": cpuinfo("13th Gen Intel(R) Core(TM) i9-13900K", cores, 5500.0,
                                 "GenuineIntel", "fpu vme de pse tsc msr avx2"),
        "/proc/meminfo": "MemTotal:       65746944 kB\nMemAvailable:   60000000 kB\n",
        "/proc/cmdline": "BOOT_IMAGE=/vmlinuz-6.8.0-49-generic root=/dev/nvme0n1p2 ro "
                         "intel_iommu=on nvidia-drm.modeset=1\n",
        "/proc/sys/kernel/osrelease": "6.8.0-49-generic\n",
        "/usr/lib/os-release": 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n',
        "/sys/devices/system/cpu/smt/control": "on\n",
        "/sys/devices/system/cpu/smt/active": "1\n",
        "/sys/devices/system/cpu/intel_pstate/no_turbo": "0\n",
        **cpufreq(32, "performance", "intel_pstate", "performance", [5500000, 4300000], 5800000),
        "/sys/kernel/mm/transparent_hugepage/enabled": "[always] madvise never\n",
        "/sys/class/drm/card0/device/vendor": "0x10de\n",
        "/sys/class/drm/card0/device/uevent": f"DRIVER=nvidia\nPCI_SLOT_NAME={NV_SLOT}\n",
        "/sys/class/iommu/dmar0/uevent": "\n",
        "/sys/class/iommu/dmar1/uevent": "\n",
        "/sys/kernel/iommu_groups/0/type": "DMA\n",
        "/sys/kernel/iommu_groups/1/type": "DMA\n",
        "/sys/kernel/iommu_groups/14/type": "DMA\n",
        f"/sys/kernel/iommu_groups/14/devices/{NV_SLOT}/": "",
        f"/sys/bus/pci/devices/{NV_SLOT}/class": "0x030000\n",
        "/sys/class/powercap/intel-rapl:0/name": "package-0\n",
        "/sys/class/powercap/intel-rapl:0/energy_uj": "2000000\n",
        "/sys/class/powercap/intel-rapl:0/max_energy_range_uj": "262143328850\n",
        "/sys/class/powercap/intel-rapl:0/constraint_0_power_limit_uw": "253000000\n",
        "/sys/class/powercap/intel-rapl:0/constraint_0_max_power_uw": "125000000\n",
        "/sys/class/hwmon/hwmon0/name": "coretemp\n",
        "/sys/class/hwmon/hwmon0/temp1_input": "41000\n",
    }


def nvidia_runner(power_row: str = NV_POWER_ROW) -> FakeRunner:
    def smi(argv):
        if len(argv) == 1:
            return NV_HEADER
        query = argv[1]
        if "power.default_limit" in query:
            return power_row
        if "driver_version" in query:
            return NV_GPU_ROW
        return "0, 301.5, 2715\n"  # the sampler's power.draw, clocks.sm
    return FakeRunner({"nvidia-smi": smi})


# -- a bare VM, modelled on the development machine (firecracker, 2 vCPUs, no GPU) ------------

VM_CMDLINE = ("console=ttyS0 quiet reboot=k panic=1 nomodule swiotlb=noforce "
              "rdinit=/process_api -- --firecracker-init --addr 0.0.0.0:2024")


def bare_vm() -> Tree:
    flags = "fpu vme de pse tsc msr hypervisor avx2 avx512f"
    return {
        "/proc/cpuinfo": cpuinfo("AMD EPYC", [(0, 0), (0, 1)], 2596.132, "AuthenticAMD", flags),
        "/proc/meminfo": "MemTotal:       24684084 kB\nMemFree:        23023796 kB\n"
                         "MemAvailable:   24261220 kB\n",
        "/proc/cmdline": VM_CMDLINE + "\n",
        "/proc/sys/kernel/osrelease": "6.18.44-fc-v669\n",
        "/etc/os-release": 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian"\n',
        "/sys/devices/system/cpu/smt/control": "notsupported\n",
        "/sys/devices/system/cpu/smt/active": "0\n",
        "/sys/devices/system/cpu/cpu0/topology/core_id": "0\n",
        "/sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never\n",
        "/sys/kernel/mm/transparent_hugepage/defrag": THP_DEFRAG,
        "/sys/class/iommu/": "",
        "/sys/kernel/iommu_groups/": "",
    }
