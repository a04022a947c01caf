"""IOMMU mode from groups' type, the units, or the kernel command line, and where it came from."""
from __future__ import annotations

from hostcheck.facts import Unavailable
from hostcheck.iommu import probe_iommu

from .trees import FakeRunner


def test_apu_passthrough_read_from_the_gpus_group(apu):
    i = probe_iommu(apu, FakeRunner())
    assert i.mode == "passthrough"
    assert i.source == "/sys/kernel/iommu_groups/2/type, the GPU's group"
    assert i.gpu_group_type == "identity" and i.group_types == {"identity": 4}
    assert i.units == ("ivhd0",) and i.cmdline == {"iommu": "pt"}


def test_desktop_translated(desktop):
    i = probe_iommu(desktop, FakeRunner())
    assert (i.mode, i.gpu_group_type, i.units) == ("translated", "DMA", ("dmar0", "dmar1"))
    assert i.cmdline == {"intel_iommu": "on"}


def test_vm_has_no_iommu(vm):
    i = probe_iommu(vm, FakeRunner())
    assert i.mode == "off" and i.units == () and "list nothing" in i.source


def test_mixed_groups_without_a_gpu(desktop):
    (desktop / "sys/kernel/iommu_groups/14/devices/0000:01:00.0").rmdir()
    (desktop / "sys/kernel/iommu_groups/1/type").write_text("identity\n")
    i = probe_iommu(desktop, FakeRunner())
    assert i.mode == "mixed" and i.source == "/sys/kernel/iommu_groups/*/type (3 groups)"


def test_cmdline_fallback_when_sysfs_is_silent(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("ro amd_iommu=off\n")
    assert probe_iommu(tmp_path, FakeRunner()).mode == "off"
    (tmp_path / "proc/cmdline").write_text("ro iommu=pt\n")
    i = probe_iommu(tmp_path, FakeRunner())
    assert i.mode == "passthrough" and i.source == "kernel command line (iommu=pt)"


def test_nothing_readable_is_unavailable(empty):
    i = probe_iommu(empty, FakeRunner())
    assert isinstance(i.mode, Unavailable) and isinstance(i.units, Unavailable)
