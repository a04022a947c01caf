"""The tiny random-weight GGUF fixtures: every arch loads in llama.cpp, and its logits are a
usable reference for another engine (finite; a clear top-1 and a peaked softmax, so argmax
agreement with llama.cpp means the computation matched, not that two coins fell alike)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine.runners.base import Span
from appliance.engine.runners.llamacpp import LlamaCppRunner

from .gguf_fixtures import TINY_ARCHS, tiny_dims, tiny_tensors, write_tiny

N_TOKENS = 64
TEXT = ("The quick brown fox jumps over the lazy dog. Meanwhile, in a small village by the sea, "
        "an old fisherman mended his nets and told stories about the storms of his youth, the "
        "ships that never came back, and the lighthouse keeper who sang to the waves every "
        "night until the lamp went dark and the harbour fell silent for good.")


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-archs")
    return {arch: write_tiny(root / f"{arch}.gguf", arch) for arch in TINY_ARCHS}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_arch_runs_in_llamacpp_with_spread_logits(tiny_paths, arch):
    r = LlamaCppRunner(EngineConfig(n_slots=1, n_ctx=256), tiny_paths[arch], "tiny")
    try:
        assert r.info.arch == ("llama" if arch == "mixtral" else arch)
        assert r.info.n_vocab == 49152
        ids = r.tokenize(TEXT, add_special=True)[:N_TOKENS]
        assert len(ids) == N_TOKENS
        (logits,) = r.forward([Span(0, tuple(ids), 0, n_logits=len(ids))])
    finally:
        r.close()
    assert logits.shape == (N_TOKENS, 49152) and np.isfinite(logits).all()
    top2 = np.sort(logits, axis=1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    p_max = 1.0 / np.exp(logits - top2[:, 1:]).sum(axis=1)
    assert np.median(gap) > 0.5, f"top-1 gap median {np.median(gap):.3f}"
    assert np.median(p_max) > 0.05 and (p_max > 0.05).mean() >= 0.9, f"p_max {np.sort(p_max)}"
    # the prediction follows the input, not one token everywhere
    assert len(set(logits.argmax(axis=1).tolist())) > N_TOKENS // 2


def _shapes(arch: str) -> dict[str, tuple[int, ...]]:
    return {name: a.shape for name, a in tiny_tensors(tiny_dims(arch))}


def test_tiny_layouts_are_what_an_engine_reads():
    """Shapes in numpy (PyTorch) order and the per-arch extras, at the default dims."""
    t = _shapes("qwen2")
    assert t["blk.0.attn_q.bias"] == (64,) and t["blk.1.attn_k.bias"] == t["blk.1.attn_v.bias"] == (32,)
    assert t["output.weight"] == t["token_embd.weight"] == (49152, 64)
    t = _shapes("qwen3")                            # head_dim 32 while n_embd / n_head is 16
    assert t["blk.0.attn_q.weight"] == (128, 64) and t["blk.0.attn_k.weight"] == (64, 64)
    assert t["blk.0.attn_output.weight"] == (64, 128)
    assert t["blk.0.attn_q_norm.weight"] == t["blk.0.attn_k_norm.weight"] == (32,)
    assert "attn_q.bias" not in " ".join(t)
    t = _shapes("mixtral")
    assert t["blk.1.ffn_gate_inp.weight"] == (4, 64) and t["blk.1.ffn_down_exps.weight"] == (4, 64, 128)
    assert "blk.0.attn_q_norm.weight" not in t and "blk.0.ffn_gate.weight" not in t


def test_tiny_file_holds_the_tensors_and_expert_keys(tiny_paths):
    """One file read back (GGUFReader takes seconds over the tokenizer, so only the MoE one)."""
    reader = gguf.GGUFReader(tiny_paths["qwen3moe"])
    f = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.")}
    assert f["general.architecture"] == "qwen3moe"
    assert (f["qwen3moe.expert_count"], f["qwen3moe.expert_used_count"]) == (4, 2)
    assert f["qwen3moe.expert_feed_forward_length"] == 128
    assert f["qwen3moe.attention.key_length"] == f["qwen3moe.attention.value_length"] == 32
    written = dict(tiny_tensors(tiny_dims("qwen3moe")))
    assert {t.name for t in reader.tensors} == set(written)
    for t in reader.tensors:
        assert t.data.shape == written[t.name].shape and np.array_equal(t.data, written[t.name]), t.name
    assert written["blk.0.ffn_gate_exps.weight"].shape == (4, 128, 64)
    assert written["blk.0.ffn_down_exps.weight"].shape == (4, 64, 128)


def test_write_tiny_refuses_what_llamacpp_could_not_run(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny arch"):
        write_tiny(tmp_path / "x.gguf", "gemma")
    with pytest.raises(ValueError, match="qwen2 needs head_dim"):
        write_tiny(tmp_path / "x.gguf", "qwen2", head_dim=32)
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_fixture_and_a_borrowed_vocab_for_a_machine_without_the_embedded_model(tmp_path, monkeypatch):
    """scripts/gpu_model.py's two halves: the tokenizer alone as a vocab-only GGUF, from which
    (APPLIANCE_FIXTURE_TOKENIZER) a fixture gets the tokenizer the embedded model would give it,
    and a fixture with its layers in Q4_1 and embedding and output in Q8_0 that llama.cpp loads
    and tokenizes as the F32 one does, computing close to it."""
    import importlib.util
    from pathlib import Path

    from appliance.fit.gguf_header import read_header

    from . import gguf_fixtures

    spec = importlib.util.spec_from_file_location(
        "gpu_model", Path(__file__).resolve().parents[2] / "scripts" / "gpu_model.py")
    gpu_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_model)
    f32 = write_tiny(tmp_path / "f32.gguf", "llama", n_embd=128, n_head=4)     # the embedded tokenizer
    keys = {k for k, *_ in gguf_fixtures.tokenizer_fields()}
    vocab = gpu_model.write_vocab(tmp_path / "vocab.gguf")
    header, tensors = read_header(vocab)[:2]
    assert not tensors and {k for k in header if k.startswith("tokenizer.")} == keys

    monkeypatch.setenv("APPLIANCE_FIXTURE_TOKENIZER", str(vocab))
    monkeypatch.setattr(gguf_fixtures, "_TOKENIZER_CACHE", None)
    q = write_tiny(tmp_path / "q.gguf", "llama", n_embd=128, n_head=4, quant="Q4_1")
    types = {t.name: t.ggml_type for t in read_header(q)[1]}
    assert types["blk.0.attn_q.weight"] == "Q4_1" and types["blk.1.ffn_down.weight"] == "Q4_1"
    assert types["token_embd.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    got = {}
    for name, path in (("f32", f32), ("q", q)):
        r = LlamaCppRunner(EngineConfig(n_slots=1, n_ctx=256), path, name)
        try:
            ids = r.tokenize(TEXT, add_special=True)[:16]
            got[name] = (ids, r.forward([Span(0, tuple(ids), 0, n_logits=1)])[0][-1])
        finally:
            r.close()
    assert got["q"][0] == got["f32"][0]
    assert np.corrcoef(got["f32"][1], got["q"][1])[0, 1] > 0.9        # 4-bit weights: near, not equal
