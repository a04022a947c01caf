"""The device check (issue 72) on the CPU: the comparison's figures, the tolerance and what it
names, the remembered verdicts and their key, the flag, and the check's whole path on llama.cpp
with the CPU standing in for the device (a CPU-only machine has no other): the same file agrees,
a copy with one tensor corrupted differs and the start is refused. The torch runner's:
test_device_check_torch.py. The device itself: tests/engine/test_vulkan.py."""
from __future__ import annotations

import numpy as np
import pytest

from appliance import config
from appliance.cli import build_parser
from appliance.config import EngineConfig
from appliance.engine import device_check as dc
from appliance.engine import device_reference as ref
from appliance.engine.logit_compare import LogitComparison, Tolerance, compare, departures, perplexity, log_softmax
from appliance.errors import ModelLoadError
from tests.engine.gguf_fixtures import corrupt_copy, write_tiny


def logits(seed: int = 0, t: int = 96, v: int = 500) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 3, (t, v)).astype(np.float32), rng.integers(0, v, t).tolist())


# -- the figures -----------------------------------------------------------------------------------

def test_the_same_logits_agree_exactly():
    x, ids = logits()
    c = compare(x, x.copy(), ids)
    assert (c.argmax_agree, c.max_abs_diff, c.kl_mean, c.kl_max, c.positions) == (1.0, 0.0, 0.0, 0.0, 96)
    assert c.ppl_device == c.ppl_cpu and c.finite and departures(c, Tolerance()) == []


def test_perplexity_is_the_next_tokens_by_hand():
    # two rows over a vocabulary of 2: row 0 predicts token 1 with p = e/(1+e), row 1 is unused
    x = np.array([[0.0, 1.0], [5.0, 0.0]], np.float32)
    p = np.e / (1 + np.e)
    assert perplexity(log_softmax(x), [0, 1]) == pytest.approx(1 / p)
    assert compare(x, x, [0, 1]).ppl_cpu == pytest.approx(1 / p)


def test_kl_is_cpu_against_device_and_never_negative():
    cpu = np.array([[0.0, 0.0]], np.float32)
    dev = np.array([[np.log(3.0), 0.0]], np.float32)              # p_dev = (3/4, 1/4)
    want = 0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25)
    c = compare(dev, cpu, [0])
    assert c.kl_mean == pytest.approx(want) and c.kl_max == pytest.approx(want) and c.kl_mean > 0
    assert c.max_abs_diff == pytest.approx(np.log(3.0), rel=1e-6) and c.argmax_agree == 1.0   # a tie: the first


def test_rounding_is_within_the_tolerance_and_garbage_is_not():
    x, _ = logits(1)
    ids = [0, *x.argmax(axis=1)[:-1].tolist()]           # a text the CPU's model predicts: perplexity 1-ish
    rng = np.random.default_rng(2)
    rounded = x + rng.normal(0, 0.01, x.shape).astype(np.float32)        # fp16 accumulation's size
    assert departures(compare(rounded, x, ids), Tolerance()) == []
    garbage, _ = logits(3)                                                # the ROCm fault: another model
    said = departures(compare(garbage, x, ids), Tolerance())
    assert any(s.startswith("argmax agreement") for s in said) and any(s.startswith("mean KL") for s in said)
    assert any("perplexity" in s for s in said)


def test_nan_on_the_device_is_named():
    x, ids = logits()
    bad = x.copy()
    bad[5, 7] = np.nan
    c = compare(bad, x, ids)
    assert not c.finite and c.max_abs_diff == float("inf")
    assert "the device gave NaN or infinite logits" in departures(c, Tolerance())


def test_shapes_must_match():
    x, ids = logits()
    with pytest.raises(ValueError, match="same"):
        compare(x[:10], x, ids)


# -- the verdict, its refusal and its memory ---------------------------------------------------------

def verdict(**kw) -> dc.DeviceVerdict:
    c = LogitComparison(96, 0.2, 31.0, 3.1, 9.0, 1334.0, 6.81, 12)
    return dc.DeviceVerdict(**{"verdict": "differs", "device": "ROCm0 (AMD Radeon 8060S)", "driver": "amdgpu 6.12",
                               "build": "llama-cpp-python 0.3.36 (libraries abc)", "model_sha256": "f" * 64,
                               "checked": "the whole model, 31 of 31 layers on ROCm0, 96 tokens",
                               "comparison": c.as_dict(), "differed": tuple(departures(c, Tolerance())), **kw})


def test_the_refusal_names_the_device_the_build_and_what_differed():
    v = verdict()
    msg = v.refusal()
    for part in ("ROCm0 (AMD Radeon 8060S)", "amdgpu 6.12", "llama-cpp-python 0.3.36 (libraries abc)",
                 "argmax agreement 20.0%", "perplexity 1334 on the device against 6.81", "--device-check warn"):
        assert part in msg, (part, msg)
    assert v.report("on")["verdict"] == "differs" and v.report("on")["mode"] == "on"


def test_a_verdict_is_remembered_under_its_own_key_only(tmp_path):
    cache = dc.VerdictCache(tmp_path)
    key = cache.key("f" * 64, "llama-cpp-python 0.3.36 (libraries abc)", "ROCm0 (AMD Radeon 8060S)", "amdgpu 6.12")
    assert cache.get(key) is None
    cache.put(key, verdict())
    got = cache.get(key)
    assert got is not None and got.cached and got.differed == verdict().differed and got.comparison["kl_max"] == 9.0
    for changed in ({"build": "llama-cpp-python 0.3.37 (libraries def)"}, {"driver": "amdgpu 6.13"},
                    {"model_sha256": "e" * 64}, {"device": "Vulkan0 (AMD Radeon 8060S)"}):
        assert cache.get({**key, **changed}) is None, changed
    cache._path(key).write_text("{not json")
    assert cache.get(key) is None and cache.all() == []


# -- the flag ------------------------------------------------------------------------------------------

def test_the_flag_defaults_on_and_takes_its_three_modes():
    assert EngineConfig().device_check == "on"
    args = build_parser().parse_args(["serve", "--device-check", "warn"])
    assert config.load(vars(args), env={}).engine.device_check == "warn"
    args = build_parser().parse_args(["serve", "--no-device-check"])
    assert config.load(vars(args), env={}).engine.device_check == "off"
    assert config.load({}, env={"APPLIANCE_DEVICE_CHECK": "off"}).engine.device_check == "off"
    with pytest.raises(ValueError, match="device_check must be off, warn or on"):
        EngineConfig(device_check="sometimes")


# -- the whole path on llama.cpp, the CPU standing in for the device ---------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("devcheck")
    good = write_tiny(d / "tiny.gguf", "llama", n_layer=2)
    return good, corrupt_copy(good, d / "tiny-corrupt.gguf", "blk.1.ffn_down.weight")


def cpu_runner(path):
    from appliance.engine.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256), path, "m")


def as_device(runner) -> dc.Target:
    return dc.Target("CPU", "the CPU standing in for a device", "2 of 2 layers and the output", 0)


def test_the_same_file_agrees_and_a_corrupted_copy_differs(tiny):
    good, bad = tiny
    for path, want in ((good, "agrees"), (bad, "differs")):
        r = cpu_runner(path)
        try:
            v = dc.run(r, as_device(r), lambda ids: ref.cpu_logits(good, ids), "build", "driver", "sha")
        finally:
            r.close()
        c = v.comparison
        assert v.verdict == want, v.describe()
        assert 64 <= c["positions"] <= 128 and v.device_s > 0 and v.cpu_s > 0
        if want == "agrees":
            assert c["argmax_agree"] == 1.0 and c["kl_max"] < 1e-3 and v.differed == ()
        else:
            assert v.differed and c["kl_mean"] > Tolerance().max_kl_mean


def test_the_start_refuses_warns_remembers_and_checks_again_for_another_build(tiny, tmp_path, monkeypatch):
    good, bad = tiny
    measured = []

    def cpu_side(path, ids, **kw):           # the CPU reads the original, the "device" the corrupted copy
        measured.append(path)
        return real(good, ids, **kw)

    real = ref.cpu_logits
    monkeypatch.setattr(ref, "cpu_logits", cpu_side)
    monkeypatch.setattr(dc, "llamacpp_target", as_device)
    r = cpu_runner(bad)
    try:
        assert dc.at_start("off", r, tmp_path) == {"mode": "off"} and not measured
        with pytest.raises(ModelLoadError, match="the device check failed: CPU .*does not compute") as e:
            dc.at_start("on", r, tmp_path)
        assert "llama-cpp-python" in e.value.message and "mean KL" in e.value.message
        assert len(measured) == 1
        warned = dc.at_start("warn", r, tmp_path)           # remembered: not measured again
        assert warned["verdict"] == "differs" and warned["cached"] and len(measured) == 1
        monkeypatch.setattr(ref, "llama_build", lambda: "llama-cpp-python 9.9.9 (libraries new)")
        again = dc.at_start("warn", r, tmp_path)             # another build: measured again
        assert again["verdict"] == "differs" and not again["cached"] and len(measured) == 2
        assert len(dc.VerdictCache(tmp_path).all()) == 2
    finally:
        r.close()


def test_a_model_with_no_layer_on_a_gpu_is_not_checked(tiny, tmp_path):
    r = cpu_runner(tiny[0])
    try:
        got = dc.at_start("on", r, tmp_path)
    finally:
        r.close()
    assert got["verdict"] == "skipped" and got["why"] == "no layer on a GPU" and got["mode"] == "on"


def test_the_model_sha256_is_remembered_by_path_size_and_mtime(tiny, tmp_path):
    import hashlib

    good, _ = tiny
    want = hashlib.sha256(good.read_bytes()).hexdigest()
    assert ref.model_sha256(good, tmp_path) == want
    memo = (tmp_path / "sha256.json").read_text()
    assert want in memo and ref.model_sha256(good, tmp_path) == want
