"""Snapshot, advice and the printed report on the fixture hosts; the CLI on this machine."""
from __future__ import annotations

import json
import subprocess
import sys

from hostcheck import as_json, check, collect, render
from hostcheck.advice import model_bytes_of
from hostcheck.facts import Unavailable

from .trees import FakeRunner, nvidia_runner, strix_halo_runner

GIB = 2**30


def snap_of(root, run):
    return collect(root, run, sleep=lambda s: None)


def by_setting(advice):
    return {a.setting: a for a in advice}


def test_the_apu_gets_every_warning(apu):
    snap = snap_of(apu, strix_halo_runner())
    advice = by_setting(check(snap, model_bytes=70 * GIB))
    assert set(advice) == {"IOMMU passthrough (iommu=pt)", "CPU governor powersave",
                           "GTT limit below the model's size", "power cap (amdgpu)"}
    assert all(a.severity == "warning" for a in advice.values())
    iommu = advice["IOMMU passthrough (iommu=pt)"]
    assert "remove iommu=pt and add amd_iommu=off on the kernel command line" in iommu.fix
    assert "13-16% of prefill" in iommu.message
    assert "cpupower frequency-set -g performance" in advice["CPU governor powersave"].fix
    gtt = advice["GTT limit below the model's size"]
    assert "64.0 GiB" in gtt.message and "70.0 GiB" in gtt.message
    # 127.5 GiB of memory, 8 GiB left to the OS: 119 GiB = 31195136 pages of 4 KiB
    assert "ttm.pages_limit=31195136" in gtt.fix and "amdgpu.gttsize=121856" in gtt.fix
    cap = advice["power cap (amdgpu)"]
    assert "70 W, below its default 120 W" in cap.message
    assert "echo 120000000 | sudo tee /sys/class/hwmon/hwmon5/power1_cap" in cap.fix


def test_apu_warnings_that_depend_on_the_model(apu):
    snap = snap_of(apu, strix_halo_runner())
    assert "GTT limit below the model's size" not in by_setting(check(snap, model_bytes=60 * GIB))
    assert "GTT limit below the model's size" not in by_setting(check(snap))


def test_translated_iommu_on_an_apu_is_a_note(apu):
    for group in (apu / "sys/kernel/iommu_groups").iterdir():
        (group / "type").write_text("DMA-FQ\n")
    advice = by_setting(check(snap_of(apu, strix_halo_runner())))
    assert advice["IOMMU translated"].severity == "note"
    assert "IOMMU passthrough (iommu=pt)" not in advice


def test_the_desktop_is_clean_until_the_model_outgrows_vram_or_the_cap_drops(desktop):
    snap = snap_of(desktop, nvidia_runner())
    assert check(snap, model_bytes=20 * GIB) == []
    assert [a.setting for a in check(snap, model_bytes=30 * GIB)] == ["model larger than VRAM"]
    capped = snap_of(desktop, nvidia_runner(power_row="0, 250.00, 300.00, 450.00, 600.00, 150.00\n"))
    (advice,) = check(capped)
    assert advice.setting == "power cap (NVIDIA GPU 0)"
    assert advice.fix == "sudo nvidia-smi -i 0 -pl 450"


def test_the_vm_has_nothing_to_warn_about_but_memory(vm):
    snap = snap_of(vm, FakeRunner())
    assert check(snap) == []
    assert [a.setting for a in check(snap, model_bytes=30 * GIB)] == ["model larger than memory"]


def test_report_text_on_each_host(apu, desktop, vm):
    text = render(snap := snap_of(apu, strix_halo_runner()), check(snap, model_bytes=70 * GIB))
    for expected in ("AMD RYZEN AI MAX+ 395", "arch gfx1151, unified memory (APU)", "ROCm 6.4.1",
                     "passthrough, read from /sys/kernel/iommu_groups/2/type, the GPU's group",
                     "AMD GPU (name unavailable (no product_name in sysfs for PCI id 1002:1586",
                     "governor powersave",
                     "GTT 64.0 GiB", "ttm.pages_limit 16777216 pages = 64.0 GiB",
                     "amdgpu (hwmon, /sys/class/hwmon/hwmon5): 69.0 W now; cap 70.0 W",
                     "Warnings (4) and notes (0):", "fix: remove iommu=pt"):
        assert expected in _flat(text), expected
    text = render(snap := snap_of(desktop, nvidia_runner()), check(snap))
    assert "NVIDIA GeForce RTX 4090 at 0000:01:00.0, arch sm_89 (Ada), dedicated VRAM" in text
    assert "Warnings: none" in text
    text = render(snap := snap_of(vm, FakeRunner()), check(snap))
    assert "GPU      none found: no display devices under /sys/class/drm" in text
    assert "inside a virtual machine" in text and "unavailable (" in text


def test_json_is_plain_and_lists_what_is_unavailable(apu, vm):
    for root, run in ((apu, strix_halo_runner()), (vm, FakeRunner())):
        snap = snap_of(root, run)
        doc = json.loads(json.dumps(as_json(snap, check(snap, model_bytes=GIB))))
        assert set(doc) == {"snapshot", "advice", "unavailable"}
        assert doc["snapshot"]["schema"] == 1
    assert doc["snapshot"]["cpu"]["governor"] == {"unavailable": doc["unavailable"]["cpu.governor"]}
    assert "gpu.gpus" in doc["unavailable"] and "power.domains" in doc["unavailable"]


def test_an_empty_root_collects_and_prints_without_raising(empty):
    snap = snap_of(empty, FakeRunner())
    assert isinstance(snap.cpu.model, Unavailable) and isinstance(snap.iommu.mode, Unavailable)
    assert snap.gpu.gpus == () and snap.power.domains == ()
    assert len(snap.unavailable()) > 15
    assert "facts unavailable on this host" in render(snap, check(snap, model_bytes=GIB))


def test_model_bytes_of_a_file_a_split_gguf_and_a_directory(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x" * 10)
    for i, n in ((1, 3), (2, 5), (3, 7)):
        (tmp_path / f"big-{i:05d}-of-00003.gguf").write_bytes(b"x" * n)
    assert model_bytes_of(tmp_path / "m.gguf") == 10
    assert model_bytes_of(tmp_path / "big-00001-of-00003.gguf") == 15
    assert model_bytes_of(tmp_path) == 25


def hostcheck(*args):
    return subprocess.run([sys.executable, "-m", "appliance", "hostcheck", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_on_this_machine_reports_and_says_what_is_unavailable():
    proc = hostcheck()
    assert proc.returncode == 0, proc.stderr
    text = _flat(proc.stdout)
    assert text.startswith("Host conditions (hostcheck, ")
    for section in ("CPU ", "Memory ", "Kernel ", "IOMMU ", "GPU ", "Power "):
        assert section in text
    doc = json.loads((js := hostcheck("--json")).stdout)
    assert js.returncode == 0
    # every fact the snapshot could not read is printed with its reason (the GTT limits only
    # matter, and are only printed, where amdgpu is loaded)
    for path, reason in doc["unavailable"].items():
        if path != "gpu.gtt_limits":
            assert _flat(reason) in text, path


def test_cli_model_size_options():
    doc = json.loads(hostcheck("--json", "--model-bytes", str(2**50)).stdout)
    assert "model larger than memory" in [a["setting"] for a in doc["advice"]]
    missing = hostcheck("--model", "/nonexistent/model.gguf")
    assert missing.returncode == 2 and "cannot read --model" in missing.stderr


def test_hostcheck_imports_nothing_from_appliance():
    code = ("import sys, hostcheck, hostcheck.readers, hostcheck.sampler;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('appliance', 'web')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_gpu_that_the_installed_llama_cpp_cannot_use(apu, desktop, vm):
    from hostcheck.advice import LlamaBuild, LlamaDevice

    cpu = LlamaDevice("CPU", "AMD EPYC", 20 * GIB, 24 * GIB)
    cpu_only = LlamaBuild("0.3.36", gpu_offload=False, devices=(cpu,))
    (a,) = [x for x in check(snap_of(desktop, nvidia_runner()), llama=cpu_only)
            if x.setting == "llama.cpp without a GPU backend"]
    assert "NVIDIA GeForce RTX 4090 is present" in a.message and "devices: CPU" in a.message
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in a.fix
    (a,) = [x for x in check(snap_of(apu, strix_halo_runner()), llama=cpu_only)
            if x.setting == "llama.cpp without a GPU backend"]
    assert "-DGGML_VULKAN=on" in a.fix and "-DAMDGPU_TARGETS=gfx1151" in a.fix
    with_gpu = LlamaBuild("0.3.36", gpu_offload=True,
                          devices=(cpu, LlamaDevice("CUDA0", "NVIDIA GeForce RTX 4090", 23 * GIB, 24 * GIB)))
    assert not [x for x in check(snap_of(desktop, nvidia_runner()), llama=with_gpu)
                if x.setting == "llama.cpp without a GPU backend"]
    assert check(snap_of(vm, FakeRunner()), llama=cpu_only) == []       # no GPU: nothing to say
    snap = snap_of(desktop, nvidia_runner())
    text = render(snap, check(snap, llama=with_gpu), with_gpu)
    assert "llama.cpp 0.3.36, GPU offload" in text and "CUDA0 (NVIDIA GeForce RTX 4090): 23.0 GiB free of 24.0 GiB" in text
    assert as_json(snap, [], with_gpu)["llama_cpp"]["devices"][1]["name"] == "CUDA0"
