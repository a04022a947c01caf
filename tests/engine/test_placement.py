"""The llama.cpp runner's placement on this CPU build: the fit planner's choice reaches llama.cpp
(tensor overrides, KV type), changes no token, and an impossible request is refused at start
with the reason."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine.runners.base import Span
from appliance.engine.runners.llamacpp import LlamaCppRunner
from appliance.errors import ModelLoadError
from appliance.models import embedded_model_path
from tests.engine.gguf_fixtures import write_tiny


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("moe") / "moe.gguf", "qwen3moe", n_layer=3, n_expert=4, n_expert_used=2)


def runner(path, **kw) -> LlamaCppRunner:
    return LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256, **kw), path, "m")


def greedy(r: LlamaCppRunner, n: int = 12) -> tuple[list[int], np.ndarray]:
    ids = r.tokenize("The lighthouse keeper", True, False)
    logits = r.forward([Span(0, tuple(ids), 0, 1)])[0][-1]
    first, out, pos = logits.copy(), [], len(ids)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = r.forward([Span(0, (out[-1],), pos, 1)])[0][-1]
        pos += 1
    r.close()
    return out, first


@pytest.fixture(scope="module")
def moe_baseline(moe):
    return greedy(runner(moe))


@pytest.mark.parametrize("kw, overridden", [
    ({"override_tensor": r"ffn_(up|down|gate)_exps=CPU"}, 9),
    ({"n_cpu_moe": 2}, 6),
    ({"cpu_moe": True}, 9),
    ({"override_tensor": r"blk\.0\.attn_q\.=CPU,blk\.1\.=CPU"}, 1 + 12),   # blk.1 has 12 tensors
])
def test_overrides_reach_llama_cpp_and_change_no_token(moe, moe_baseline, caplog, kw, overridden):
    caplog.set_level(logging.DEBUG, logger="appliance.llamacpp")
    r = runner(moe, **kw)
    lines = [rec.getMessage() for rec in caplog.records if "buffer type overridden to CPU" in rec.getMessage()]
    assert len(lines) == overridden                      # llama.cpp says so, tensor by tensor
    assert r.info.placement["overrides"] and r.info.placement["fits"]
    assert r.info.placement["llama_devices"][0]["name"] == "CPU"
    tokens, first = greedy(r)
    assert tokens == moe_baseline[0]
    assert np.array_equal(first, moe_baseline[1])


@pytest.mark.parametrize("kw, message", [
    ({"override_tensor": "ffn=CUDA0"}, "this llama.cpp build has no device 'CUDA0' (it has CPU)"),
    ({"override_tensor": "ffn=GPU0"}, "no device 'GPU0'"),
    ({"n_gpu_layers": "all"}, "no GPU backend"),
    ({"n_gpu_layers": "4"}, "CMAKE_ARGS"),
    ({"main_gpu": 1, "n_gpu_layers": "auto"}, None),            # no GPU: nothing to choose, not an error
])
def test_impossible_requests_are_refused_before_loading(moe, kw, message):
    if message is None:
        runner(moe, **kw).close()
        return
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner(moe, **kw)


@pytest.mark.parametrize("kw, message", [
    ({"override_tensor": "ffn"}, "expected REGEX=DEVICE"),
    ({"override_tensor": "ffn(=CPU"}, "bad regular expression"),
    ({"cpu_moe": True, "n_cpu_moe": 1}, "not both"),
    ({"kv_type": "q5_1"}, "kv_type must be"),
    ({"kv_type": "q8_0", "engine": "torch"}, "llama.cpp runner only"),
    ({"n_gpu_layers": "-1"}, "n_gpu_layers must be"),
])
def test_bad_placement_flags_are_refused_by_the_config(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_a_quantised_kv_cache_is_smaller_and_says_so():
    f16 = runner(embedded_model_path())
    q8 = runner(embedded_model_path(), kv_type="q8_0")
    try:
        assert q8.info.kv_bytes == f16.info.kv_bytes * 34 // 64   # q8_0: 34 bytes per 32 values
        assert q8.info.settings["kv_type"] == "q8_0" and q8.info.settings["flash_attn"] is True
        assert "kv=q8_0" in q8.kv_fingerprint() and "kv=f16" in f16.kv_fingerprint()
        assert q8.info.placement["kv_type"] == "q8_0"
        assert q8.info.placement["devices"]["CPU"]["kv"] == q8.info.kv_bytes   # the planner's KV is the runner's
        assert f16.info.placement["devices"]["CPU"]["kv"] == f16.info.kv_bytes
    finally:
        f16.close()
        q8.close()
    tokens, _ = greedy(runner(embedded_model_path(), kv_type="q8_0"))
    assert len(tokens) == 12


@pytest.mark.parametrize("kw", [{}, {"kv_type": "q8_0"}, {"n_ctx": 2048, "n_slots": 4}])
def test_the_planned_bytes_are_what_llama_cpp_allocates(caplog, kw):
    """llama.cpp states each buffer's size as it allocates it; the planner predicted them."""
    import re

    caplog.set_level(logging.INFO, logger="appliance.llamacpp")
    cfg = {"n_slots": 1, "n_ctx": 256, **kw}
    r = LlamaCppRunner(EngineConfig(plan="off", **cfg), embedded_model_path(), "m")
    r.close()
    got = {}
    for rec in caplog.records:
        for dev, kind, mib in re.findall(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB", rec.getMessage()):
            got[kind] = got.get(kind, 0.0) + float(mib)
    cpu = r.info.placement["devices"]["CPU"]
    assert got["model"] == pytest.approx(sum(cpu["weights"].values()) / 2**20, abs=0.1)
    assert got["KV"] == pytest.approx(cpu["kv"] / 2**20, abs=0.1)
    assert got["compute"] == pytest.approx(cpu["compute"] / 2**20, rel=0.15)   # an estimate: within 15%


def test_the_kv_fingerprint_holds_the_placement(moe):
    """A saved state restores bit for bit only where it is computed the same way: on the same
    devices, with the same layers and tensors on each (the disk tier and the probe memo key on
    it). Free memory is no part of it."""
    def fingerprint(**kw) -> str:
        r = runner(moe, **kw)
        try:
            return r.kv_fingerprint()
        finally:
            r.close()
    plain = fingerprint()
    assert plain == fingerprint() and "devices=CPU:" in plain and "n_gpu_layers=0" in plain
    moved = {fingerprint(n_cpu_moe=1), fingerprint(cpu_moe=True), fingerprint(override_tensor=r"blk\.0\.attn_q\.=CPU")}
    assert len(moved) == 3 and plain not in moved


def test_what_llama_cpp_allocated_is_in_the_placement_beside_the_plan():
    """/health shows the buffers llama.cpp said it allocated at load beside the planned bytes."""
    r = runner(embedded_model_path())
    try:
        p = r.info.placement
    finally:
        r.close()
    cpu = p["devices"]["CPU"]
    assert p["allocated"]["CPU"]["KV"] == pytest.approx(cpu["kv"], abs=2**20 / 100)   # MiB with 2 decimals
    assert sum(b.get("model", 0) for b in p["allocated"].values()) == pytest.approx(sum(cpu["weights"].values()),
                                                                                  abs=2**20 / 100)


def test_a_load_that_fails_inside_llama_cpp_says_why(tmp_path):
    from tests.engine.gguf_fixtures import write_tiny_llama

    broken = write_tiny_llama(tmp_path / "broken.gguf")
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) * 2 // 3])     # the header reads; the tensor data is cut short
    with pytest.raises(ModelLoadError, match="could not load this file as a GGUF model; llama.cpp said: .*"):
        runner(broken)


def test_a_gpu_that_got_less_than_planned_is_noted():
    """llama.cpp falls back to host memory, silently, for a tensor larger than a device buffer
    may be (seen on Vulkan with GGML_VK_FORCE_MAX_ALLOCATION_SIZE): the placement says so."""
    import dataclasses

    from appliance.engine.runners.ggml_devices import GgmlDevice
    from appliance.engine.runners.placement import RunnerPlacement
    from appliance.fit.devices import GIB, Device
    from appliance.fit.model import from_gguf
    from appliance.fit.planner import FitRequest, plan

    facts = from_gguf(embedded_model_path())
    placement = plan(facts, FitRequest(n_ctx=512), [Device("CPU", "cpu", 8 * GIB), Device("GPU0", "gpu", 8 * GIB)])
    gpu = GgmlDevice(1, "Vulkan0", "llvmpipe", "gpu", 2 * GIB, 2 * GIB, 0, "GPU0", True)
    placed = RunnerPlacement(placement, facts, [dataclasses.replace(gpu, index=0, name="CPU", kind="cpu"), gpu],
                             None, "Vulkan0", names={"GPU0": "Vulkan0"})
    use = placement.use["GPU0"]
    placed.record_allocations([f"load_tensors:      Vulkan0 model buffer size = {sum(use.weights.values()) / 2**20:.2f} MiB",
                               f"llama_kv_cache:      Vulkan0 KV buffer size = {use.kv / 2**20:.2f} MiB"])
    assert placed.drift() == [] and placed.allocated["Vulkan0"]["KV"] == pytest.approx(use.kv, abs=6000)
    placed.allocated["Vulkan0"]["model"] = 136315
    assert placed.drift() == ["llama.cpp allocated 0.1 MiB of model buffers on Vulkan0 where 92.1 MiB were "
                              "planned: the rest is in host memory"]
    assert placed.summary()["notes"][-1] == placed.drift()[0]
