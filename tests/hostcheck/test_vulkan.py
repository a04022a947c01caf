"""Vulkan devices through the Vulkan loader: the packing of versions and heaps, the probe on this
machine (whatever it has: never an exception), and how the report shows a software device (Mesa's
lavapipe, which llama.cpp calls a discrete GPU though its memory is the host's)."""
from __future__ import annotations

import dataclasses

from hostcheck import render
from hostcheck.advice import LlamaBuild, LlamaDevice
from hostcheck.facts import Unavailable
from hostcheck.snapshot import collect
from hostcheck.vulkan import VulkanDevice, device_local, probe_vulkan, version

from .trees import FakeRunner

GIB = 2**30
LLVMPIPE = VulkanDevice("llvmpipe (LLVM 15.0.6, 256 bits)", "cpu", "1.3.230", 0x10005, 2 * GIB)


def test_versions_and_heaps_unpack():
    assert version((1 << 22) | (3 << 12) | 230) == "1.3.230"
    assert version((1 << 29) | (1 << 22) | (4 << 12) | 309) == "1.4.309"        # a variant bit set
    assert device_local([(2 * GIB, 1), (8 * GIB, 0), (GIB, 3)]) == 3 * GIB
    assert LLVMPIPE.host_memory and dataclasses.replace(LLVMPIPE, type="integrated").host_memory
    assert not dataclasses.replace(LLVMPIPE, type="discrete").host_memory


def test_the_probe_on_this_machine_never_raises(monkeypatch):
    found = probe_vulkan()
    assert isinstance(found, (tuple, Unavailable))
    for d in found if isinstance(found, tuple) else ():
        assert d.name and d.type in ("integrated", "discrete", "virtual", "cpu", "other")
    monkeypatch.setattr("ctypes.util.find_library", lambda name: "libvulkan-not-here.so.9")
    assert probe_vulkan() == Unavailable("no Vulkan loader (libvulkan.so.1)")


def test_a_fixture_tree_does_not_read_the_live_loader(vm):
    snap = collect(vm, FakeRunner(), sleep=lambda s: None)
    assert isinstance(snap.gpu.vulkan, Unavailable) and "below" in snap.gpu.vulkan.reason


def test_the_report_says_a_software_device_holds_host_memory(vm):
    snap = collect(vm, FakeRunner(), sleep=lambda s: None)
    snap = dataclasses.replace(snap, gpu=dataclasses.replace(snap.gpu, vulkan=(LLVMPIPE,)))
    llama = LlamaBuild("0.3.36", True, (LlamaDevice("CPU", "AMD EPYC", 24 * GIB, 24 * GIB, "cpu"),
                                        LlamaDevice("Vulkan0", LLVMPIPE.name, 2 * GIB, 2 * GIB, "gpu", True)))
    text = " ".join(render(snap, [], llama).split())
    assert ("Vulkan: llvmpipe (LLVM 15.0.6, 256 bits) (CPU-type: software on the host's cores, its memory "
            "host memory), API 1.3.230, device-local heaps 2.0 GiB") in text
    assert ("Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)): 2.0 GiB free of 2.0 GiB; host memory (a software "
            "device on the CPU, which llama.cpp calls a discrete GPU, uma: 0): planned as unified") in text


def test_the_report_says_why_vulkan_is_unavailable(vm):
    snap = collect(vm, FakeRunner(), sleep=lambda s: None)
    snap = dataclasses.replace(snap, gpu=dataclasses.replace(
        snap.gpu, vulkan=Unavailable("no Vulkan loader (libvulkan.so.1)")))
    text = " ".join(render(snap, []).split())
    assert "Vulkan: unavailable (no Vulkan loader (libvulkan.so.1))" in text
