"""The device check when the whole model's CPU side does not fit (engine/device_slice.py,
device_partial.py): the first and last layers and the output head written as a model of their
own, run on the device and on the CPU. With the CPU standing in for the device, as in
test_device_check.py: a slice of every layer is the model itself, logit for logit; a slice of a
six-layer model loads and agrees with itself; one whose device side reads a corrupted copy is
refused; what does not fit is skipped, said, and tried again at the next start."""
from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import gguf
import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine import device_check as dc, device_partial, device_reference as ref, device_slice
from appliance.errors import ModelLoadError
from tests.engine.gguf_fixtures import corrupt_copy, write_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("devpartial")
    good = write_tiny(d / "tiny6.gguf", "llama", n_layer=6)
    return good, corrupt_copy(good, d / "tiny6-corrupt.gguf", "blk.5.ffn_down.weight"), d


def ids_of(path: Path) -> list[int]:
    from appliance.engine.runners.llamacpp import LlamaCppRunner

    r = LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256), path, "m")
    try:
        return dc.check_ids(r)
    finally:
        r.close()


def test_a_slice_of_every_layer_is_the_model_itself(tmp_path):
    whole = write_tiny(tmp_path / "tiny4.gguf", "llama", n_layer=4, seed=3)
    cut = device_slice.write(whole, tmp_path / "slice.gguf")
    assert cut.keep == (0, 1, 2, 3) and cut.n_layer == 4
    ids = ids_of(whole)
    a, b = ref.cpu_logits(whole, ids), ref.cpu_logits(tmp_path / "slice.gguf", ids)
    assert a.shape == b.shape and np.array_equal(a, b)


def test_the_slice_keeps_the_ends_renumbered_with_their_per_layer_values(tmp_path):
    """A file the shape of a DeepSeek or GLM one: a dense first layer, a per-layer array, an MTP
    layer at the end. Read back, not loaded (llama.cpp's llama has none of these)."""
    src, dst = tmp_path / "meta.gguf", tmp_path / "meta-slice.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(8)
    w.add_uint32("llama.leading_dense_block_count", 1)
    w.add_uint32("llama.nextn_predict_layers", 1)
    w.add_array("llama.feed_forward_length", [10, 11, 12, 13, 14, 15, 16, 17])
    w.add_array("llama.rope.dimension_sections", [1, 2, 3])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for i in range(8):
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.full((2, 8), i, np.float32))
    w.add_tensor("output.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    cut = device_slice.write(src, dst)
    assert cut.keep == (0, 1, 5, 6, 7) and "layers 0, 1, 5, 6, 7 of 8 and the output head" == cut.describe()
    r = gguf.GGUFReader(dst)
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith("llama.")}
    assert f["llama.block_count"] == 5 and f["llama.leading_dense_block_count"] == 1
    assert f["llama.nextn_predict_layers"] == 1 and f["llama.feed_forward_length"] == [10, 11, 15, 16, 17]
    assert f["llama.rope.dimension_sections"] == [1, 2, 3]
    tensors = {t.name: t for t in r.tensors}
    assert sorted(tensors) == sorted(["token_embd.weight", "output.weight",
                                      *(f"blk.{i}.ffn_down.weight" for i in range(5))])
    assert [int(tensors[f"blk.{i}.ffn_down.weight"].data.flat[0]) for i in range(5)] == [0, 1, 5, 6, 7]
    assert cut.nbytes == sum(int(t.n_bytes) for t in r.tensors) and not dst.with_name(dst.name + ".part").exists()


# -- the whole path, the CPU standing in for the device ----------------------------------------------

Memory = namedtuple("Memory", "available")


def runner(path):
    from appliance.engine.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256), path, "m")


def too_big(r) -> dc.Target:
    """The CPU standing in for a device, holding a model whose CPU side would need 1 PiB."""
    return dc.Target("CPU", "the CPU standing in for a device", "6 of 6 layers and the output", 2**50)


def test_a_model_too_big_for_its_cpu_side_is_checked_by_its_first_and_last_layers(tiny, tmp_path, monkeypatch):
    good, bad, _ = tiny
    monkeypatch.setattr(dc, "llamacpp_target", too_big)
    r = runner(good)
    try:
        v = dc.checked(r, dc.VerdictCache(tmp_path))
    finally:
        r.close()
    assert v.verdict == "agrees", v.describe()
    assert v.checked.startswith("layers 0, 1, 4, 5 of 6 and the output head, as a 4-layer model on CPU and on the CPU "
                                "(the whole model's CPU side needs about 1048576.0 GiB")
    assert v.comparison["argmax_agree"] == 1.0 and v.comparison["kl_max"] == 0.0
    assert v.tolerance == device_partial.PARTIAL_TOLERANCE.as_dict() and v.device_s > 0 and v.cpu_s > 0
    assert dc.VerdictCache(tmp_path).get(dc.VerdictCache.key(v.model_sha256, v.build, v.device, v.driver)) is not None
    assert not list(tmp_path.glob("slice-*")), "the slice is removed after the check"


def test_a_corrupted_last_layer_on_the_device_side_of_the_slice_is_refused(tiny, tmp_path, monkeypatch):
    good, bad, _ = tiny
    monkeypatch.setattr(dc, "llamacpp_target", too_big)
    r = runner(bad)                      # the device side slices the runner's (corrupted) file
    try:
        v = dc.checked(r, None, reference_path=good)
    finally:
        r.close()
    assert v.verdict == "differs" and v.differed and v.comparison["kl_mean"] > 1.0, v.describe()
    assert "layers 0, 1, 4, 5 of 6" in v.refusal()


def test_the_start_refuses_a_slice_that_differs(tiny, tmp_path, monkeypatch):
    good, bad, _ = tiny
    real, calls = ref.file_logits, []

    def cpu_reads_the_original(path, ids, device, **kw):
        calls.append(path)
        if len(calls) == 2:              # the CPU side: a slice of the original, the device's of the copy
            device_slice.write(good, path.with_name("good-slice.gguf"))
            path = path.with_name("good-slice.gguf")
        return real(path, ids, device, **kw)

    monkeypatch.setattr(ref, "file_logits", cpu_reads_the_original)
    monkeypatch.setattr(dc, "llamacpp_target", too_big)
    r = runner(bad)
    try:
        with pytest.raises(ModelLoadError, match=r"the device check failed: CPU .*\(layers 0, 1, 4, 5 of 6"):
            dc.at_start("on", r, tmp_path)
    finally:
        r.close()


def test_what_does_not_fit_even_sliced_is_skipped_and_tried_again(tiny, tmp_path, monkeypatch):
    import psutil

    good, _, _ = tiny
    monkeypatch.setattr(dc, "llamacpp_target", too_big)
    r = runner(good)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(1024))   # after the load: 1 KiB free
    try:
        got = dc.at_start("on", r, tmp_path)
    finally:
        r.close()
    assert got["verdict"] == "skipped" and got["mode"] == "on"
    assert "the whole model's CPU side needs about" in got["why"]
    assert "layers 0, 1, 4, 5 of 6 and the output head need about" in got["why"] and got["why"].endswith("not checked")
    assert dc.VerdictCache(tmp_path).all() == [], "a skipped check is not remembered: the next start tries again"
