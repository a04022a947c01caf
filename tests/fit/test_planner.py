"""The fit planner against hostcheck's fixture hosts and the tensor tables of real models built
from their published shapes. Expected placements are worked out in each test from the table
itself (bytes per layer and role) and the devices' budgets, not read back from the planner."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest

from appliance.fit import devices as dev
from appliance.fit import planner, shapes
from appliance.fit.devices import GIB
from appliance.fit.planner import FitRequest, kv_bytes, place, plan

GB = 10**9


@pytest.fixture(scope="module")
def models():
    return {name: shapes.build(name) for name in shapes.SHAPES}


def gpu_of(devices):
    return next(d for d in devices if d.kind == "gpu")


# -- tables and sizes -------------------------------------------------------------------------

@pytest.mark.parametrize("name, published_gb", [("Llama-3.1-8B-Q4_K_M", 4.92), ("Llama-3.3-70B-Q4_K_M", 42.5),
                                                ("Qwen3-30B-A3B-Q4_K_M", 18.6)])
def test_tables_from_published_shapes_weigh_what_the_published_files_do(models, name, published_gb):
    assert models[name].weight_bytes / GB == pytest.approx(published_gb, rel=0.01)


def test_roles_and_the_expert_share(models):
    oss = models["gpt-oss-120b-MXFP4"]
    assert oss.is_moe and not models["Llama-3.1-8B-Q4_K_M"].is_moe
    experts = sum(t.nbytes for t in oss.tensors if t.role == "expert")
    assert experts / oss.weight_bytes > 0.95           # 128 experts x 3 matrices x 36 layers in MXFP4
    assert {t.role for t in oss.tensors} == {"embed", "output", "attn", "expert"}
    assert {t.role for t in models["Llama-3.1-8B-Q4_K_M"].tensors} == {"embed", "output", "attn", "ffn"}


def test_kv_bytes_by_hand(models):
    m = models["Llama-3.1-8B-Q4_K_M"]
    req = FitRequest(n_ctx=8192, n_slots=4)
    # 32 layers x 8 KV heads x (128 + 128) x 2 bytes x 32,768 positions = 4 GiB
    assert sum(kv_bytes(m, i, req) for i in range(32)) == 4 * GIB
    q8 = FitRequest(n_ctx=8192, n_slots=4, kv_type="q8_0")     # 34 bytes per 32 values
    assert sum(kv_bytes(m, i, q8) for i in range(32)) == 4 * GIB * 34 // 64
    oss = models["gpt-oss-120b-MXFP4"]
    # the even layers keep a 128-position window and one micro-batch per slot
    assert kv_bytes(oss, 0, req) == 4 * (128 + 512) * 8 * 128 * 2
    assert kv_bytes(oss, 1, req) == 4 * 8192 * 8 * 128 * 2
    # --kv-unified: one pool of n_ctx for the 4 slots, and a window per sequence in it
    shared = FitRequest(n_ctx=8192, n_slots=4, kv_unified=True)
    assert sum(kv_bytes(m, i, shared) for i in range(32)) == GIB
    assert kv_bytes(oss, 0, shared) == (4 * 128 + 512) * 8 * 128 * 2
    assert kv_bytes(oss, 1, shared) == 8192 * 8 * 128 * 2


def test_a_host_short_of_kv_for_every_slot_is_told_a_shared_pool_fits(hosts, models):
    devices = dev.from_snapshot(hosts["vm"])
    qwen = models["Qwen3-30B-A3B-Q4_K_M"]
    tight = plan(qwen, FitRequest(n_ctx=8192, n_slots=8), devices)    # 6 GiB of KV beside 17.3 of weights
    assert not tight.fits
    assert "would fit with --kv-unified (the slots share one pool of --n-ctx positions)" in tight.notes
    shared = plan(qwen, FitRequest(n_ctx=8192, n_slots=8, kv_unified=True), devices)
    assert shared.fits and shared.use["CPU"].kv == 6 * GIB // 8 and shared.to_dict()["kv_unified"] is True


# -- devices ------------------------------------------------------------------------------------

def test_devices_of_the_fixture_hosts(hosts):
    apu = dev.from_snapshot(hosts["apu"])
    assert [d.name for d in apu] == ["CPU", "GPU0"]
    gpu = gpu_of(apu)
    # 512 MiB carve-out + GTT capped at 64 GiB (mem_info_gtt_total and ttm.pages_limit agree)
    assert gpu.unified and gpu.carve_out == GIB // 2 and gpu.budget == GIB // 2 + 64 * GIB
    desktop = dev.from_snapshot({"snapshot": hosts["desktop"]})   # `hostcheck --json` holds it under "snapshot"
    vram = hosts["desktop"]["gpu"]["gpus"][0]["vram_bytes"]
    assert gpu_of(desktop).budget == vram - max(vram // 20, GIB // 2) and not gpu_of(desktop).unified
    vm = dev.from_snapshot(hosts["vm"])
    total = hosts["vm"]["memory"]["total_bytes"]
    assert [d.kind for d in vm] == ["cpu"] and vm[0].budget == total - dev.host_reserve(total)
    with pytest.raises(ValueError, match="total_bytes"):
        dev.from_snapshot({"memory": {"total_bytes": {"unavailable": "no /proc"}}})


# -- placements ---------------------------------------------------------------------------------

def test_a_model_that_fits_goes_whole_to_the_gpu(hosts, models):
    devices = dev.from_snapshot(hosts["desktop"])
    p = plan(models["Llama-3.1-8B-Q4_K_M"], FitRequest(n_ctx=8192, n_slots=4), devices)
    assert p.fits and p.n_gpu_layers == 33 and not p.overrides and not p.n_cpu_moe
    assert set(p.layers.values()) == {"GPU0"}
    assert p.where["output.weight"] == "GPU0" and p.where["token_embd.weight"] == "CPU"
    assert p.use["GPU0"].kv == 4 * GIB and p.use["CPU"].kv == 0


def test_a_vision_projector_is_counted_on_its_device(hosts, models):
    devices, m = dev.from_snapshot(hosts["desktop"]), models["Llama-3.1-8B-Q4_K_M"]
    base = plan(m, FitRequest(n_ctx=8192, n_slots=4), devices)
    on_gpu = plan(m, FitRequest(n_ctx=8192, n_slots=4, projector=(GIB, True)), devices)
    on_cpu = plan(m, FitRequest(n_ctx=8192, n_slots=4, projector=(GIB, False)), devices)
    assert on_gpu.use["GPU0"].total == base.use["GPU0"].total + GIB and on_gpu.use["CPU"].total == base.use["CPU"].total
    assert on_cpu.use["CPU"].total == base.use["CPU"].total + GIB and on_cpu.use["GPU0"].total == base.use["GPU0"].total
    cpu_only = [d for d in devices if d.kind == "cpu"]          # no GPU: offload or not, it is the host's
    assert plan(m, FitRequest(n_ctx=8192, n_slots=4, projector=(GIB, True)), cpu_only).use["CPU"].weights["projector"] == GIB


def test_moe_experts_leave_the_24gb_card_first_layer_by_layer(hosts, models):
    m, devices = models["gpt-oss-120b-MXFP4"], dev.from_snapshot(hosts["desktop"])
    req = FitRequest(n_ctx=8192, n_slots=4)
    p = plan(m, req, devices)
    # by hand: everything but the experts on the GPU, then as many layers' experts as still fit
    gpu = gpu_of(devices)
    fixed = place(m, req, devices, m.n_layer + 1, m.n_layer, 0).use["GPU0"].total
    per_layer = [m.bytes_by(i, "expert") for i in range(m.n_layer)]
    k = next(k for k in range(m.n_layer + 1) if fixed + sum(per_layer[k:]) <= gpu.budget)
    assert p.fits and p.n_gpu_layers == m.n_layer + 1 and p.n_cpu_moe == k and 0 < k < m.n_layer
    assert p.n_cpu_ffn == 0 and set(p.layers.values()) == {"GPU0"}    # attention and KV all on the GPU
    assert p.where["blk.0.ffn_up_exps.weight"] == "CPU" and p.where[f"blk.{k}.ffn_up_exps.weight"] == "GPU0"
    assert p.where["blk.0.attn_q.weight"] == "GPU0"
    assert p.overrides == ((r"blk\.(" + "|".join(map(str, range(k))) + r")\.ffn_(up|down|gate|gate_up)_exps", "CPU"),)
    assert 0 <= p.use["GPU0"].headroom < per_layer[k - 1]


def test_a_dense_model_keeps_attention_and_kv_and_moves_ffns(hosts, models):
    m, devices = models["Llama-3.3-70B-Q4_K_M"], dev.from_snapshot(hosts["desktop"])
    req = FitRequest(n_ctx=8192, n_slots=4)
    p = plan(m, req, devices)
    fixed = place(m, req, devices, m.n_layer + 1, 0, m.n_layer).use["GPU0"].total
    per_layer = [m.bytes_by(i, "ffn") for i in range(m.n_layer)]
    k = next(k for k in range(m.n_layer + 1) if fixed + sum(per_layer[k:]) <= gpu_of(devices).budget)
    assert p.fits and p.n_gpu_layers == 81 and p.n_cpu_ffn == k and p.n_cpu_moe == 0
    assert set(p.layers.values()) == {"GPU0"} and p.use["GPU0"].kv == 10 * GIB
    assert p.use["CPU"].weights["ffn"] == sum(per_layer[:k])


def test_whole_layers_leave_when_attention_and_kv_alone_do_not_fit(hosts, models):
    m, devices = models["Llama-3.3-70B-Q4_K_M"], dev.from_snapshot(hosts["desktop"])
    req = FitRequest(n_ctx=16384, n_slots=4)           # KV 20 GiB: with attention, more than the card
    p = plan(m, req, devices)
    assert p.fits and p.n_cpu_ffn == m.n_layer and p.n_gpu_layers < m.n_layer
    on_gpu = sorted(i for i, d in p.layers.items() if d == "GPU0")
    # as llama.cpp does: the output counts as the last layer, so N layers are it and the last N - 1
    assert on_gpu == list(range(m.n_layer + 1 - p.n_gpu_layers, m.n_layer))
    assert p.where["output.weight"] == "GPU0"
    one_more = place(m, req, devices, p.n_gpu_layers + 1, 0, m.n_layer)
    assert not one_more.fits


def test_the_apu_holds_gpt_oss_120b_whole_in_gtt(hosts, models):
    p = plan(models["gpt-oss-120b-MXFP4"], FitRequest(n_ctx=8192, n_slots=4), dev.from_snapshot(hosts["apu"]))
    assert p.fits and p.n_gpu_layers == 37 and not p.overrides and not p.notes


def test_a_low_gtt_limit_on_the_apu_says_which_kernel_setting_to_raise(hosts, models):
    snap = copy.deepcopy(hosts["apu"])
    snap["gpu"]["gtt_limits"]["ttm_pages_limit"] = 32 * GIB // 4096     # 32 GiB
    devices = dev.from_snapshot(snap)
    assert gpu_of(devices).budget == GIB // 2 + 32 * GIB
    m = models["gpt-oss-120b-MXFP4"]
    p = plan(m, FitRequest(n_ctx=8192, n_slots=4), devices)
    assert p.fits and 0 < p.n_cpu_moe < m.n_layer
    need = place(m, FitRequest(n_ctx=8192, n_slots=4), devices, 37, 0, 0).use["GPU0"].total - GIB // 2
    pages = math.ceil((need + GIB) / GIB) * GIB // 4096
    assert any(f"ttm.pages_limit={pages}" in n and "amdgpu.gttsize is deprecated" in n for n in p.notes)


def test_on_an_apu_host_and_gpu_share_one_pool(hosts, models):
    snap = copy.deepcopy(hosts["apu"])
    snap["memory"]["total_bytes"] = snap["memory"]["available_bytes"] = 64 * GIB   # a 64 GiB APU, GTT 64 GiB
    devices = dev.from_snapshot(snap)
    m = models["gpt-oss-120b-MXFP4"]      # 59 GiB of weights: the GTT would hold it, the host cannot
    p = plan(m, FitRequest(n_ctx=8192, n_slots=4), devices)
    assert not p.fits
    assert any("maps host memory" in n for n in p.notes)
    assert not any("ttm.pages_limit" in n for n in p.notes)   # raising the GTT limit would not help


def test_cpu_only_hosts_and_what_would_fit(hosts, models):
    devices = dev.from_snapshot(hosts["vm"])
    big = plan(models["Llama-3.3-70B-Q4_K_M"], FitRequest(n_ctx=8192, n_slots=4), devices)
    assert not big.fits and big.n_gpu_layers == 0
    assert any("weights alone are 39.6 GiB" in n for n in big.notes)
    qwen = models["Qwen3-30B-A3B-Q4_K_M"]
    # KV 6 GiB on top of 17.3 GiB of weights, against 21.2 GiB; q8_0 (with flash attention) saves
    # 2.8 GiB of KV and the attention scores of the compute buffer
    tight = plan(qwen, FitRequest(n_ctx=8192, n_slots=8), devices)
    assert not tight.fits and tight.use["CPU"].kv == 6 * GIB
    q8 = place(qwen, FitRequest(n_ctx=8192, n_slots=8, kv_type="q8_0", flash_attn=True), devices, 0, 0, 0)
    assert q8.fits and q8.use["CPU"].kv == 6 * GIB * 34 // 64
    assert "would fit with --kv-type q8_0" in tight.notes and "would fit with --n-slots 4" in tight.notes
    assert "would fit with --n-ctx 4096" in tight.notes
    assert plan(qwen, FitRequest(n_ctx=8192, n_slots=4, kv_type="q8_0"), devices).fits


# -- the user's choices are kept ----------------------------------------------------------------

def test_fixed_gpu_layers_cpu_moe_and_overrides_are_kept(hosts, models):
    devices = dev.from_snapshot(hosts["desktop"])
    llama = models["Llama-3.1-8B-Q4_K_M"]
    p = plan(llama, FitRequest(n_ctx=8192, n_slots=4, n_gpu_layers=10), devices)
    assert p.fits and sorted(i for i, d in p.layers.items() if d == "GPU0") == list(range(23, 32))
    assert p.where["output.weight"] == "GPU0"                    # the tenth of llama.cpp's ten
    qwen = models["Qwen3-30B-A3B-Q4_K_M"]
    p = plan(qwen, FitRequest(n_ctx=8192, n_slots=4, n_cpu_moe=qwen.n_layer), devices)
    assert p.fits and p.use["GPU0"].weights["expert"] == 0 and p.overrides[0][0].startswith(r"blk\.\d+")
    p = plan(llama, FitRequest(n_ctx=8192, n_slots=4, overrides=((r"attn_q\.", "CPU"),)), devices)
    assert all(d == "CPU" for n, d in p.where.items() if "attn_q." in n)
    assert p.where["blk.3.attn_k.weight"] == "GPU0" and p.overrides[0] == (r"attn_q\.", "CPU")


def test_an_impossible_fixed_placement_is_refused_with_the_numbers(hosts, models):
    devices = dev.from_snapshot(hosts["desktop"])
    m = models["Llama-3.3-70B-Q4_K_M"]
    p = plan(m, FitRequest(n_ctx=32768, n_slots=4, n_gpu_layers=81), devices)   # KV alone is 40 GiB
    assert not p.fits
    assert any(n.startswith("GPU0 needs") and "GiB more than its" in n for n in p.notes)
    assert any(n.startswith("would fit with --n-slots") or n.startswith("would fit with --n-ctx")
               or n.startswith("would fit with --kv-type") for n in p.notes)


def test_the_planner_is_pure(hosts, models):
    devices = dev.from_snapshot(hosts["desktop"])
    m = models["gpt-oss-120b-MXFP4"]
    a = plan(m, FitRequest(n_ctx=8192, n_slots=4), devices)
    b = plan(m, FitRequest(n_ctx=8192, n_slots=4), devices)
    assert a == b and a.to_dict() == b.to_dict()
    assert planner.plan.__module__ == "appliance.fit.planner"


def test_a_header_read_by_ranges_is_the_header_read_from_disk():
    """`appliance pull` reads a Hub file's header by byte ranges before downloading it: a small
    first read, then doubling, until the header ends inside what was read."""
    from appliance.fit.gguf_header import PastEnd, read_header, read_header_ranged
    from appliance.models import embedded_model_path

    path = embedded_model_path()
    data = path.read_bytes()
    calls = []

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return data[offset:offset + length]

    meta, infos = read_header_ranged(read, len(data), first=4096)
    want_meta, want_infos = read_header(path)
    assert infos == want_infos and meta == want_meta
    assert calls[0] == (0, 4096) and all(o == sum(n for _, n in calls[:i]) for i, (o, _) in enumerate(calls))
    assert sum(n for _, n in calls) < 4 * 2 ** 20 < len(data)        # a few MiB of a 98 MB file
    with pytest.raises(PastEnd):
        read_header_ranged(read, len(data), first=4096, limit=65536)


# -- a GPU only llama.cpp sees: a software Vulkan device --------------------------------------

def _with_llama_devices(snap: dict, *gpus: dict) -> dict:
    cpu = {"name": "CPU", "description": "AMD EPYC", "free_bytes": 24 * GIB, "total_bytes": 24 * GIB, "kind": "cpu"}
    return {"snapshot": snap, "llama_cpp": {"version": "0.3.36", "gpu_offload": bool(gpus), "devices": [cpu, *gpus]}}


LAVAPIPE = {"name": "Vulkan0", "description": "llvmpipe (LLVM 15.0.6, 256 bits)", "free_bytes": 2 * GIB,
            "total_bytes": 2 * GIB, "kind": "gpu", "host_memory": True}


def test_a_software_vulkan_device_is_planned_as_host_memory(hosts, models):
    """lavapipe: no PCI device, so only llama.cpp lists it; a "discrete" GPU to llama.cpp
    (uma: 0) whose 2 GiB are the host's. Planned from its free memory, as unified: what it holds
    counts against the host's budget too."""
    devices = dev.from_snapshot(_with_llama_devices(hosts["vm"], LAVAPIPE))
    gpu = gpu_of(devices)
    assert [d.name for d in devices] == ["CPU", "GPU0"] and gpu.unified and gpu.carve_out == 0
    assert gpu.budget == 2 * GIB - GIB // 4 and "llvmpipe" in gpu.how and "host memory" in gpu.how
    cpu = devices[0]
    m = models["Llama-3.1-8B-Q4_K_M"]
    p = plan(m, FitRequest(n_ctx=4096, n_slots=1), devices)
    assert p.fits and p.n_cpu_ffn > 0                               # 2 GiB hold attention, not every FFN
    assert not any("ttm.pages_limit" in n for n in p.notes)         # no GTT to raise: it is no APU
    squeezed = [dev.Device("CPU", "cpu", p.use["CPU"].total + p.use["GPU0"].total - 1), gpu]
    assert not place(m, p.request, squeezed, p.n_gpu_layers, 0, p.n_cpu_ffn).fits   # one pool: the host's
    assert place(m, p.request, [replace(cpu, budget=squeezed[0].budget), replace(gpu, unified=False)],
                 p.n_gpu_layers, 0, p.n_cpu_ffn).fits              # counted apart, it would seem to fit


def test_llama_cpp_devices_are_ignored_where_hostcheck_found_the_gpu(hosts):
    card = {**LAVAPIPE, "name": "CUDA0", "description": "RTX 4090", "host_memory": False}
    devices = dev.from_snapshot(_with_llama_devices(hosts["desktop"], card))
    assert [d.name for d in devices] == ["CPU", "GPU0"] and "VRAM" in gpu_of(devices).how
    plain = dev.from_snapshot(_with_llama_devices(hosts["vm"], {**LAVAPIPE, "host_memory": False}))
    assert not gpu_of(plain).unified                                 # a real card's own memory


def test_n_gpu_layers_counts_the_output_as_llama_cpp_does(hosts, models):
    """llama-model.cpp: i_gpu_start = n_layer + 1 - n_gpu_layers, the output being layer n_layer.
    Seen on llama.cpp's Vulkan backend (scripts/vulkan_check.sh): -ngl 1 put the output alone
    on Vulkan0, -ngl 15 of the embedded model's 30 layers the output and 14 layers."""
    m, devices = models["Llama-3.1-8B-Q4_K_M"], dev.from_snapshot(hosts["desktop"])
    req = FitRequest(n_ctx=4096, n_slots=1)
    for ngl, layers in ((0, []), (1, []), (2, [31]), (16, list(range(17, 32))), (33, list(range(32)))):
        p = place(m, req, devices, ngl, 0, 0)
        assert sorted(i for i, d in p.layers.items() if d == "GPU0") == layers
        assert p.where["output.weight"] == ("GPU0" if ngl else "CPU")
        assert p.use["GPU0"].kv == sum(kv_bytes(m, i, req) for i in layers)


def test_a_gpu_build_computes_big_batches_on_the_gpu(hosts, models):
    """Op offload: llama.cpp runs a batch of 32 tokens or more on the GPU whatever holds the
    weights, so the GPU's compute buffer is the graph's peak even with no layer there (plus a
    copy of the host weights it multiplies by), and the host's only its inputs and the mask.
    On Vulkan, embedded model, 512-token micro-batch: -ngl 0 gave Vulkan0 132.5 MB of compute
    (the logits' 100.7 MB and a copy of the 30.1 MB output) and the host 4.2 MB."""
    m, devices = models["Llama-3.1-8B-Q4_K_M"], dev.from_snapshot(hosts["desktop"])
    req = FitRequest(n_ctx=4096, n_slots=1, flash_attn=True)          # the logits are the peak
    nothing, everything = place(m, req, devices, 0, 0, 0), place(m, req, devices, 33, 0, 0)
    output = sum(t.nbytes for t in m.tensors if t.role == "output")       # the output and its norm
    assert nothing.use["GPU0"].compute == everything.use["GPU0"].compute + output
    assert nothing.use["CPU"].compute == everything.use["CPU"].compute < everything.use["GPU0"].compute // 10
    cpu_only = place(m, req, [devices[0]], 0, 0, 0)                 # no GPU: the CPU computes it all
    assert cpu_only.use["CPU"].compute == planner.compute_bytes(m, req, True, True)


@pytest.mark.parametrize("n_ctx, flash_attn, measured", [
    (256, False, 1835008), (2048, False, 7350518), (512, True, 2925527), (256, True, 1352663), (2048, True, 4498391)])
def test_the_host_compute_beside_a_gpu_is_what_llama_cpp_allocated_on_vulkan(n_ctx, flash_attn, measured):
    """The host's compute buffer (Vulkan_Host) llama.cpp allocated for the embedded model with
    every layer on lavapipe (scripts/vulkan_check.sh), one slot, 512-token micro-batches: the
    mask is float32 or, with flash attention (a quantised KV), float16 and the rest smaller.
    Planned at 0.78x of it with flash attention before the Vulkan run showed it."""
    from appliance.fit.model import from_gguf
    from appliance.models import embedded_model_path

    m = from_gguf(embedded_model_path())
    req = FitRequest(n_ctx=n_ctx, n_slots=1, flash_attn=flash_attn, kv_type="q8_0" if flash_attn else "f16")
    assert planner.host_compute_bytes(m, req) == pytest.approx(measured, rel=0.05)
