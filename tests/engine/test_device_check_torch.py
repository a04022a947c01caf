"""The device check (issue 72) for the torch runner, on the CPU: at start as on demand (`appliance
check --engine torch`), with the CPU standing in for the CUDA or ROCm device (a CPU-only machine
has no other; `device_of` says it is one): the same model agrees and serves, the verdict is
remembered and a restart reuses it, another torch build checks again, a CPU side reading a copy
with one tensor corrupted is refused (on) or served (warn); a torch runner on the CPU is skipped;
a CPU side that would not fit is skipped, saying so. The key's digest of a checkpoint directory."""
from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine import device_check as dc, device_check_torch as dct, device_reference as ref  # noqa: E402
from appliance.errors import ModelLoadError  # noqa: E402
from tests.engine.gguf_fixtures import corrupt_copy, write_tiny  # noqa: E402

STAND_IN = ("cpu", "the CPU standing in for a device")


def torch_cfg(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), engine="torch", torch_device="cpu", n_ctx=256, n_slots=1, plan="off", **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("devcheck-torch")
    good = write_tiny(d / "tiny.gguf", "llama", n_layer=2)
    return good, corrupt_copy(good, d / "tiny-corrupt.gguf", "blk.1.ffn_down.weight")


@pytest.fixture(scope="module")
def runner(tiny):
    """The torch runner on the tiny model, loaded once for the module (the "device" side)."""
    from appliance.engine.runners import make_runner

    r = make_runner(torch_cfg(tiny[0]), tiny[0], "m")
    yield r
    r.close()


@pytest.fixture
def cpu_sides(monkeypatch):
    """The CPU standing in for the device; each CPU side measured is counted by the file it read
    (`path`: a file to read instead of the model's)."""
    real = dct.cpu_reference
    state = SimpleNamespace(read=[], path=None)

    def counted(cfg, path, alias):
        reads = state.path or path
        side = real(cfg, reads, alias)

        def logits(ids):
            state.read.append(reads)
            return side(ids)
        return logits

    monkeypatch.setattr(dct, "device_of", lambda r: STAND_IN)
    monkeypatch.setattr(dct, "cpu_reference", counted)
    return state


def test_the_start_agrees_remembers_and_checks_again_for_another_build(runner, tiny, cpu_sides, tmp_path,
                                                                        monkeypatch):
    cfg = torch_cfg(tiny[0])
    got = dc.at_start("on", runner, tmp_path, cfg=cfg)
    assert got["verdict"] == "agrees" and got["engine"] == "torch" and not got["cached"], got
    assert got["comparison"]["argmax_agree"] == 1.0 and got["device_s"] > 0 and got["cpu_s"] > 0
    assert got["model_sha256"] == hashlib.sha256(tiny[0].read_bytes()).hexdigest()
    assert got["build"].startswith("torch ") and got["device"] == "cpu (the CPU standing in for a device)"
    assert len(cpu_sides.read) == 1
    again = dc.at_start("on", runner, tmp_path, cfg=cfg)                # a restart: remembered
    assert again["verdict"] == "agrees" and again["cached"] and len(cpu_sides.read) == 1
    monkeypatch.setattr(dct, "torch_build", lambda: "torch 9.9.9, CUDA 99.9")
    other = dc.at_start("on", runner, tmp_path, cfg=cfg)                # another build: measured again
    assert other["verdict"] == "agrees" and not other["cached"] and other["build"] == "torch 9.9.9, CUDA 99.9"
    assert len(cpu_sides.read) == 2 and len(dc.VerdictCache(tmp_path).all()) == 2
    assert "off" == dc.at_start("off", runner, tmp_path, cfg=cfg)["mode"] and len(cpu_sides.read) == 2


def test_a_cpu_side_that_differs_is_refused_or_served_with_warn(runner, tiny, cpu_sides, tmp_path):
    good, bad = tiny
    cpu_sides.path = bad                    # the CPU side reads a corrupted copy: the two differ
    with pytest.raises(ModelLoadError, match=r"the device check failed: cpu \(the CPU standing in") as e:
        dc.at_start("on", runner, tmp_path / "on", cfg=torch_cfg(good))
    for part in ("the torch runner's CPU path", "torch ", "--torch-device cpu", "mean KL", "--device-check warn"):
        assert part in e.value.message, (part, e.value.message)
    warned = dc.at_start("warn", runner, tmp_path / "warn", cfg=torch_cfg(good))
    assert warned["verdict"] == "differs" and warned["differed"] and warned["mode"] == "warn"
    assert cpu_sides.read == [bad, bad]


def test_the_torch_runner_on_the_cpu_is_not_checked(runner, tiny, tmp_path):
    got = dc.at_start("on", runner, tmp_path, cfg=torch_cfg(tiny[0]))
    assert got["verdict"] == "skipped" and got["why"] == dc.NO_GPU and got["engine"] == "torch"
    assert dc.VerdictCache(tmp_path).all() == []


def test_a_cpu_side_that_would_not_fit_is_skipped_saying_so(runner, tiny, cpu_sides, tmp_path, monkeypatch):
    import psutil

    cfg = torch_cfg(tiny[0], torch_dtype="float32")       # float32: no int4, every weight at 4 bytes
    need = dct.cpu_side_bytes(runner, cfg)
    elements = sum(int(np.prod(t.shape)) for t in runner.weights.tensors.values())
    a = runner.args
    assert need == (elements + a.n_layer * 256 * 2 * a.n_head_kv * a.head_dim) * 4 + dct.CPU_MARGIN
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=need - 1))
    got = dc.at_start("on", runner, tmp_path, cfg=cfg)
    assert got["verdict"] == "skipped" and "the CPU side needs about" in got["why"] and "not checked" in got["why"]
    assert cpu_sides.read == [] and dc.VerdictCache(tmp_path).all() == []


def test_a_checkpoint_directory_is_keyed_by_its_files_listing(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 100)
    first = ref.model_sha256(d, tmp_path / "memo")
    assert first == ref.listing_sha256(d) == ref.model_sha256(d, None) and dct.model_bytes(d) == 102
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ref.model_sha256(d, None) != first


# -- `appliance check --engine torch`: the same path, measured afresh and remembered ------------------

def test_the_torch_runner_without_a_gpu_is_refused_clearly(tiny, monkeypatch):
    torch = pytest.importorskip("torch")
    from appliance.check_command import torch_verdict

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # as on a machine without one
    with pytest.raises(ModelLoadError, match="no CUDA or ROCm device here"):
        torch_verdict(EngineConfig(model=str(tiny[0]), engine="torch", n_ctx=256, n_slots=1, plan="off"))
    with pytest.raises(ModelLoadError, match="no CUDA or ROCm device here"):   # loaded, found on the CPU
        torch_verdict(torch_cfg(tiny[0]), allow_cpu=True)


def test_appliance_check_measures_afresh_and_the_start_remembers_it(tiny, runner, cpu_sides, tmp_path, monkeypatch):
    from appliance.check_command import torch_verdict

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    for _ in range(2):
        v = torch_verdict(torch_cfg(tiny[0]), allow_cpu=True)
        assert v.verdict == "agrees" and not v.cached and v.comparison["argmax_agree"] == 1.0, v.describe()
        assert v.device.startswith("cpu") and v.build.startswith("torch") and v.engine == "torch"
    assert len(cpu_sides.read) == 2
    started = dc.at_start("on", runner, tmp_path / "appliance" / "device-check", cfg=torch_cfg(tiny[0]))
    assert started["cached"] and started["verdict"] == "agrees" and len(cpu_sides.read) == 2
