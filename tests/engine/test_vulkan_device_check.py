"""The device check (issue 72) on a llama.cpp Vulkan device: run by scripts/vulkan_check.sh in its
venv (GGML_VK_VISIBLE_DEVICES=0 lists Mesa's lavapipe); anywhere else they skip, saying why.

The engine's start with every layer on Vulkan0 agrees with llama.cpp's CPU backend and serves,
and a restart reads the remembered verdict instead of measuring. The fault: a copy of the model
whose one tensor (blk.1.ffn_down.weight, on the device) has every sign bit flipped, loaded on the
device, while the CPU side reads the original. It is honest: the device really computes with the
corrupted bytes through its own shaders, exactly as a device whose copy or kernel went wrong
would, and nothing on the device side knows; only the reference differs, as the CPU's would from
a faulty GPU's. The start is refused, naming the device, the build and what differed. The same
for a model whose CPU side is made not to fit: its first and last layers, as a model of their
own, on the device (device_partial.py).
"""
from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.engine import device_reference as ref
from appliance.engine import startup
from appliance.errors import ModelLoadError
from tests.engine.gguf_fixtures import corrupt_copy, write_tiny
from tests.engine.test_vulkan import DEVICE, WHY

pytestmark = [pytest.mark.vulkan, pytest.mark.skipif(DEVICE is None, reason=WHY)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("vkcheck")
    good = write_tiny(d / "tiny.gguf", "llama", n_layer=2)
    return good, corrupt_copy(good, d / "tiny-corrupt.gguf", "blk.1.ffn_down.weight")


def start(path, **kw):
    cfg = EngineConfig(model=str(path), plan="off", n_slots=1, n_ctx=256, n_gpu_layers="all", speculate="off",
                       prompt_cache="off", **kw)
    return startup.start(cfg, lambda event: None)


def test_the_device_agrees_the_start_serves_and_a_restart_remembers(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    engine = start(models[0])
    try:
        got = engine.info.settings["device_check"]
    finally:
        engine.close()
    assert got["verdict"] == "agrees" and not got["cached"] and got["device"].startswith(DEVICE.name), got
    assert got["comparison"]["argmax_agree"] >= 0.9 and 64 <= got["comparison"]["positions"] <= 128
    assert "llama-cpp-python" in got["build"] and got["driver"] != "unknown"
    monkeypatch.setattr(ref, "cpu_logits", lambda *a, **kw: pytest.fail("measured again"))
    engine = start(models[0])
    try:
        again = engine.info.settings["device_check"]
    finally:
        engine.close()
    assert again["cached"] and again["comparison"] == got["comparison"]


def test_a_corrupted_tensor_on_the_device_is_caught_and_the_start_refused(models, tmp_path, monkeypatch):
    good, bad = models
    real = ref.cpu_logits
    monkeypatch.setattr(ref, "cpu_logits", lambda path, ids, **kw: real(good, ids, **kw))   # the CPU: the original
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        start(bad)
    msg = e.value.message
    assert f"the device check failed: {DEVICE.name} ({DEVICE.description})" in msg
    assert "llama-cpp-python" in msg and "mean KL" in msg, msg
    engine = start(bad, device_check="warn")                  # warn: serves, the verdict in /health
    try:
        assert engine.info.settings["device_check"]["verdict"] == "differs"
    finally:
        engine.close()


# -- a model whose CPU side does not fit: its first and last layers on the device (device_partial.py) --

@pytest.fixture(scope="module")
def six(tmp_path_factory):
    d = tmp_path_factory.mktemp("vkslice")
    good = write_tiny(d / "tiny6.gguf", "llama", n_layer=6)
    return good, corrupt_copy(good, d / "tiny6-corrupt.gguf", "blk.5.ffn_down.weight")


def test_a_model_too_big_for_its_cpu_side_is_checked_by_its_slice_on_the_device(six, tmp_path, monkeypatch):
    import dataclasses

    from appliance.engine import device_check as dc
    from appliance.engine import device_slice

    good, bad = six
    real_target, real_logits = dc.llamacpp_target, ref.file_logits
    monkeypatch.setattr(dc, "llamacpp_target", lambda r: dataclasses.replace(real_target(r), cpu_side_bytes=2**50))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    engine = start(good)
    try:
        got = engine.info.settings["device_check"]
    finally:
        engine.close()
    assert got["verdict"] == "agrees", got
    assert got["checked"].startswith(f"layers 0, 1, 4, 5 of 6 and the output head, as a 4-layer model on {DEVICE.name}")
    assert got["comparison"]["argmax_agree"] >= 0.9 and got["device_s"] > 0 and got["cpu_s"] > 0

    def cpu_reads_the_original(path, ids, device, **kw):   # the device slices the corrupted copy
        if device is None:
            device_slice.write(good, path.with_name("good-slice.gguf"))
            path = path.with_name("good-slice.gguf")
        return real_logits(path, ids, device, **kw)

    monkeypatch.setattr(ref, "file_logits", cpu_reads_the_original)
    with pytest.raises(ModelLoadError, match=rf"the device check failed: {DEVICE.name} .*layers 0, 1, 4, 5 of 6"):
        start(bad)
