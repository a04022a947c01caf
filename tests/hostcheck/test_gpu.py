"""GPU probes: amdgpu sysfs + KFD on the APU, nvidia-smi on the desktop, nothing in the VM."""
from __future__ import annotations

from hostcheck.facts import Unavailable
from hostcheck.gpu import probe_gpus
from hostcheck.gpu_amd import dpm_states, gfx_name

from .trees import APU_SLOT, NV_SLOT, FakeRunner, nvidia_runner, strix_halo_runner


def test_the_apu_gpu(apu):
    report = probe_gpus(apu, strix_halo_runner())
    assert len(report.gpus) == 1  # card1-eDP-1 is a connector, not a second GPU
    g = report.gpus[0]
    assert (g.vendor, g.arch, g.pci_slot, g.unified) == ("AMD", "gfx1151", APU_SLOT, True)
    assert g.driver == "amdgpu (in-tree, kernel 6.17.0-5-generic)"
    assert g.runtime == "ROCm 6.4.1-120"
    assert g.vram_bytes == 512 * 2**20 and g.gtt_bytes == 64 * 2**30
    assert g.cur_mhz == 2229.0 and g.max_mhz == 2900.0  # hwmon freq1_input; top DPM state
    assert isinstance(g.name, Unavailable) and "1002:1586" in g.name.reason
    limits = report.gtt_limits
    assert limits.ttm_pages_limit == 16777216 and limits.ttm_limit_bytes == 64 * 2**30
    assert limits.amdgpu_gttsize_mib == 65536
    assert limits.cmdline == {"amdgpu.gttsize": "65536", "ttm.pages_limit": "16777216"}


def test_amd_name_and_arch_from_rocminfo_when_sysfs_lacks_them(apu):
    for p in (apu / "sys/class/kfd").rglob("properties"):
        p.unlink()
    rocminfo = ("ROCk module is loaded\n*******\nAgent 1\n*******\n"
                "  Name:                    AMD RYZEN AI MAX+ 395 w/ Radeon 8060S\n"
                "  Marketing Name:          AMD RYZEN AI MAX+ 395 w/ Radeon 8060S\n"
                "  Device Type:             CPU\n*******\nAgent 2\n*******\n"
                "  Name:                    gfx1151\n"
                "  Marketing Name:          AMD Radeon Graphics\n"
                "  Device Type:             GPU\n")
    run = FakeRunner({"rocminfo": rocminfo})
    g = probe_gpus(apu, run).gpus[0]
    assert (g.arch, g.name) == ("gfx1151", "AMD Radeon Graphics")
    assert run.calls.count(("rocminfo",)) == 1  # one snapshot runs a tool once


def test_amd_clock_from_dpm_when_hwmon_has_no_clock(apu):
    (apu / "sys/class/drm/card1/device/hwmon/hwmon5/freq1_input").unlink()
    g = probe_gpus(apu, FakeRunner()).gpus[0]
    assert g.cur_mhz == 1200.0  # the state marked with *


def test_the_nvidia_desktop(desktop):
    report = probe_gpus(desktop, nvidia_runner())
    assert len(report.gpus) == 1  # the drm card and the nvidia-smi row are one device
    g = report.gpus[0]
    assert (g.vendor, g.name, g.pci_slot) == ("NVIDIA", "NVIDIA GeForce RTX 4090", NV_SLOT)
    assert g.arch == "sm_89 (Ada)" and g.unified is False
    assert g.driver == "nvidia 570.133.07" and g.runtime == "CUDA 12.8 (the driver's)"
    assert g.vram_bytes == 24564 * 2**20
    assert (g.cur_mhz, g.max_mhz) == (2520.0, 3105.0)
    assert isinstance(g.gtt_bytes, Unavailable)
    assert isinstance(report.gtt_limits, Unavailable)  # amdgpu not loaded


def test_nvidia_card_without_nvidia_smi_is_listed_with_the_reason(desktop):
    (desktop / "proc/driver/nvidia").mkdir(parents=True)
    (desktop / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.07  Fri Feb 28 2025\n")
    report = probe_gpus(desktop, FakeRunner())
    g = report.gpus[0]
    assert g.vendor == "NVIDIA" and g.pci_slot == NV_SLOT and g.driver == "nvidia 570.133.07"
    assert isinstance(g.name, Unavailable) and "nvidia-smi not found" in g.name.reason


def test_nvidia_smi_not_available_values(desktop):
    row = "0, NVIDIA GB10, 0000000F:01:00.0, 580.95.05, [N/A], 12.1, 2418, [N/A]\n"
    run = FakeRunner({"nvidia-smi": lambda argv: row if len(argv) > 1 else "no header"})
    g = next(g for g in probe_gpus(desktop, run).gpus if g.source == "nvidia-smi")
    assert g.unified is True and g.arch == "sm_121 (Blackwell)" and g.pci_slot == "000f:01:00.0"
    assert isinstance(g.vram_bytes, Unavailable) and isinstance(g.max_mhz, Unavailable)
    assert isinstance(g.runtime, Unavailable)


def test_no_gpu_in_the_vm(vm):
    report = probe_gpus(vm, FakeRunner())
    assert report.gpus == ()
    assert report.not_found == ("no display devices under /sys/class/drm",
                                "NVIDIA: nvidia-smi not found on PATH")


def test_gfx_names_and_dpm_parsing():
    assert [gfx_name(v) for v in (110501, 90010, 90402, 100300)] == [
        "gfx1151", "gfx90a", "gfx942", "gfx1030"]
    assert dpm_states("0: 600Mhz\n1: 2900Mhz *\n") == [(600.0, False), (2900.0, True)]
    assert isinstance(dpm_states("garbage"), Unavailable)
