"""The llama.cpp runner on a Vulkan device (issue 45): run by scripts/vulkan_check.sh in its
venv, where llama.cpp is built with -DGGML_VULKAN=on and GGML_VK_VISIBLE_DEVICES=0 lists Mesa's
lavapipe (a Vulkan device that runs on the CPU). Anywhere else they skip, saying why.

What each test holds: the planner's bytes are what llama.cpp allocated on the device (weights
and KV within 5%, compute within 15%); overrides, --cpu-moe and a quantised KV reach the device;
the device computes the model the CPU computes; a state computed on the device is never restored
where the CPU computes (the KV fingerprint); the start-up probes answer and the appliance follows
them; a placement too big for the device is refused before loading, and a load llama.cpp fails
says why. Tiny generated models: lavapipe is slow (first use compiles its pipelines).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine.runners import ggml_devices
from appliance.engine.runners.base import Span
from appliance.errors import ModelLoadError
from appliance.models import embedded_model_path
from tests.engine.gguf_fixtures import write_tiny, write_tiny_llama
from tests.engine.test_placement import greedy   # closes the runner


def _vulkan() -> tuple[ggml_devices.GgmlDevice | None, str]:
    built = (ggml_devices._LIB_DIR / "libggml-vulkan.so").exists()
    dev = next((d for d in ggml_devices.devices() if d.name.startswith("Vulkan")), None)
    if dev is not None:
        return dev, ""
    if built:
        return None, ("llama.cpp is built with Vulkan but lists no Vulkan device (a CPU-type one such as "
                      "lavapipe needs GGML_VK_VISIBLE_DEVICES=0)")
    return None, "the installed llama.cpp has no Vulkan backend (scripts/vulkan_check.sh builds one)"


DEVICE, WHY = _vulkan()
pytestmark = [pytest.mark.vulkan, pytest.mark.skipif(DEVICE is None, reason=WHY)]
GOAL = {"model": 0.05, "KV": 0.05, "compute": 0.15}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("vk") / "tiny.gguf", n_head=2, n_head_kv=1,   # heads of 32: q4_0 and q8_0 blocks fit
                            n_ctx=2048)   # trained for the longest context asked of it (issue 50 refuses past it)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("vk") / "moe.gguf", "qwen3moe", n_layer=3, n_expert=4, n_expert_used=2)


def runner(path: Path, **kw):
    from appliance.engine.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(EngineConfig(plan="off", **{"n_slots": 1, "n_ctx": 256, **kw}), path, "m")


def on_device(placement: dict) -> dict[str, tuple[int, int]]:
    """kind -> (planned, allocated) on the Vulkan device."""
    use, got = placement["devices"]["GPU0"], placement["allocated"].get(DEVICE.name, {})
    planned = {"model": sum(use["weights"].values()), "KV": use["kv"], "compute": use["compute"]}
    return {k: (v, got.get(k, 0)) for k, v in planned.items()}


def test_the_device_holds_host_memory_and_is_planned_so():
    assert DEVICE.kind in ("gpu", "igpu") and DEVICE.total > 0
    if "llvmpipe" in DEVICE.description:            # lavapipe says uma: 0, but its memory is the host's
        assert DEVICE.kind == "gpu" and DEVICE.host_memory and DEVICE.memory == "host"


@pytest.mark.parametrize("kw", [{"n_gpu_layers": "all"}, {"n_gpu_layers": "auto"}, {"n_gpu_layers": "2"},
                                {"n_gpu_layers": "all", "kv_type": "q8_0"}, {"n_gpu_layers": "all", "kv_type": "q4_0"},
                                {"n_gpu_layers": "all", "n_ctx": 2048, "n_slots": 2}])
def test_the_planned_bytes_are_what_llama_cpp_allocated_on_the_device(tiny, kw):
    r = runner(tiny, **kw)
    try:
        p = r.info.placement
        tokens, _ = greedy(r, 4)
    finally:
        r.close()
    assert p["gpu"] == "GPU0" and not p["notes"] and len(tokens) == 4
    for kind, (planned, got) in on_device(p).items():
        assert got == pytest.approx(planned, rel=GOAL[kind], abs=2**20 / 50), kind
    if kw.get("kv_type"):
        assert r.info.settings["flash_attn"] is True


@pytest.mark.parametrize("kw, on_cpu", [({"n_gpu_layers": "all", "cpu_moe": True}, 9),
                                        ({"n_gpu_layers": "all", "n_cpu_moe": 1}, 3),
                                        ({"n_gpu_layers": "0", "override_tensor": r"blk\.[12]\.ffn_(up|down|gate)_exps=Vulkan0"},
                                         3)])
def test_expert_placement_reaches_the_device(moe, kw, on_cpu):
    r = runner(moe, **kw)
    try:
        p = r.info.placement
        greedy(r, 2)
    finally:
        r.close()
    experts = {n: d for n, d in p_where(moe, kw).items() if "_exps" in n}
    assert sum(d == "CPU" for d in experts.values()) == on_cpu
    for kind, (planned, got) in on_device(p).items():
        if planned:
            assert got == pytest.approx(planned, rel=GOAL[kind], abs=2**20 / 50), kind


def p_where(path: Path, kw: dict) -> dict[str, str]:
    """The planner's tensor -> device for these flags (what the runner passed llama.cpp)."""
    from appliance.engine.runners.placement import place_model

    return place_model(EngineConfig(plan="off", n_slots=1, n_ctx=256, **kw), path, False).placement.where


def test_the_device_computes_the_model_the_cpu_computes():
    """The embedded model's first logits and greedy tokens, all on Vulkan0 against no layer there
    (nor any op: a one-token step stays on the CPU; the prompt's matrix products do not)."""
    dev, cpu = runner(embedded_model_path(), n_gpu_layers="all"), runner(embedded_model_path(), n_gpu_layers="0")
    try:
        (dev_tokens, dev_first), (cpu_tokens, cpu_first) = greedy(dev), greedy(cpu)
    finally:
        dev.close()
        cpu.close()
    assert int(np.argmax(dev_first)) == int(np.argmax(cpu_first))
    assert np.abs(dev_first - cpu_first).max() < 1.0 and np.corrcoef(dev_first, cpu_first)[0, 1] > 0.999
    assert dev_tokens[:4] == cpu_tokens[:4]


def test_a_state_computed_on_the_device_is_not_restored_where_the_cpu_computes(tiny):
    """The KV fingerprint (the disk tier's and the probe memo's key) holds the placement: a state
    saved with every layer on Vulkan0 and restored with none continues with other bits than the
    CPU's own prefill, so it must not be restored there. (A prompt under 32 tokens: from 32 on,
    llama.cpp's op offload computes even the CPU-placed prompt on the device.)"""
    ids = tuple(range(40, 60))
    dev, cpu = runner(tiny, n_gpu_layers="all"), runner(tiny, n_gpu_layers="0")
    try:
        assert dev.kv_fingerprint() != cpu.kv_fingerprint() and "n_gpu_layers=0" in cpu.kv_fingerprint()
        dev.forward([Span(0, ids, 0, 1)])
        saved = dev.save(0)
        cold = cpu.forward([Span(0, ids, 0, 1)])[0]
        cpu_next = cpu.forward([Span(0, (7,), len(ids), 1)])[0]
        cpu.restore(0, saved)
        restored_next = cpu.forward([Span(0, (7,), len(ids), 1)])[0]
    finally:
        dev.close()
        cpu.close()
    assert cold.shape[0] == 1 and not np.array_equal(cpu_next, restored_next)


def test_the_start_up_probes_answer_and_the_appliance_follows(tiny):
    """Whether a 9-row verify equals 9 steps on the device, and from which cut a prompt's KV is
    what the grid computes: the policy follows each answer (speculation off with the reason
    where not exact; the prompt cache reuses to the token only from a proven cut)."""
    from appliance.engine.cache.invariance import check_chunk_invariance, probe_prompt
    from appliance.engine.spec import CostModel, decide
    from appliance.engine.spec.probe import check_exact

    r = runner(tiny, n_gpu_layers="all", n_ctx=512)
    try:
        ids = r.tokenize("The quick brown fox jumps over the lazy dog. " * 40, add_special=False)
        exact = check_exact(r, 0, ids[:252], k=8)
        found = check_chunk_invariance(r, 0, probe_prompt(r, 64), 64)
    finally:
        r.close()
    policy = decide("auto", False, exact, CostModel())
    if exact.exact:
        assert policy.default == "lookup"
    else:
        assert policy.default == "off" and "differs from one-token steps" in policy.reason
        with pytest.raises(ValueError, match="--speculate-inexact"):
            decide("lookup", False, exact, CostModel())
    assert found.min_chunk in (0, 1, 2, 4, 16, 17) and found.cases > 0
    assert found.min_chunk == 1 or found.failed          # reuse coarser than a token only with a reason


def test_a_placement_beyond_the_device_is_refused_before_loading():
    budget_kv = DEVICE.total // (30 * 3 * 128 * 2) + 1            # positions whose f16 KV alone passes it
    slots = -(-budget_kv // 8192)
    with pytest.raises(ModelLoadError, match=r"does not fit as asked(.|\n)*GPU0 needs"):
        runner(embedded_model_path(), n_gpu_layers="all", n_ctx=8192, n_slots=slots)


@pytest.mark.parametrize("force, expect", [
    ({"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(2**20)}, "could not create a context of 1 x 256 positions; llama.cpp "
                                                    "said: .*failed to allocate Vulkan0 buffer"),
    ({"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(2**20), "GGML_VK_FORCE_MAX_ALLOCATION_SIZE": str(2**20)},
     "NOTE llama.cpp allocated .* MiB of model buffers on Vulkan0 where .* MiB were planned"),
])
def test_what_llama_cpp_does_with_a_device_that_gives_less(force, expect):
    """A device that refuses a buffer the planner counted on (forced by ggml-vulkan's own test
    variables, in a process of its own: the device reads them once): a clear error naming the
    device; or, where llama.cpp falls back to host memory by itself, a note in the placement."""
    code = ("from appliance.config import EngineConfig\n"
            "from appliance.engine.runners.llamacpp import LlamaCppRunner\n"
            "from appliance.errors import ModelLoadError\n"
            "from appliance.models import embedded_model_path\n"
            "try:\n"
            "    r = LlamaCppRunner(EngineConfig(plan='off', n_slots=1, n_ctx=256, n_gpu_layers='all'),"
            " embedded_model_path(), 'm')\n"
            "    print('NOTE', *r.info.placement['notes'])\n"
            "except ModelLoadError as e:\n"
            "    print('ERROR', e.message)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **force})
    assert re.search(expect, run.stdout), run.stdout + run.stderr[-2000:]
