"""NVFP4 end to end: `appliance quantize --to nvfp4` writes a GGUF that llama.cpp reads on its
own NVFP4 kernels, and the torch runner on the same file agrees with llama.cpp as closely as
llama.cpp agrees with itself (flash attention on against off), teacher-forced.

Measured here (300 tokens of filler, tiny float32 fixtures quantized to NVFP4): llama.cpp
flash attention on vs off 97.0-98.3% of argmaxes (KL 0.0013-0.0015; its NVFP4 dot quantizes
activations to 8 bits); the torch runner (bfloat16) 95.7-98.3% (KL 0.0022-0.0041). A runner
that ignored the quantization (the float32 source against the NVFP4 copy) agrees on 56%
(KL 0.61-0.73), so the bounds below tell a right decoder from a wrong one."""
from __future__ import annotations

import json

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

import gguf  # noqa: E402

from appliance.cli import main  # noqa: E402
from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.spec.probe import check_exact  # noqa: E402
from appliance.quantize import QuantizeError, agreement, quantize_file, teacher_forced  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402
from .test_torch_runner import N_TOKENS, TEXT  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("nvfp4")
    out = {}
    for arch in ("llama", "qwen3moe"):
        src = write_tiny(d / f"{arch}.gguf", arch)
        assert main(["quantize", "--to", "nvfp4", str(src), str(d / f"{arch}-nvfp4.gguf")]) == 0
        out[arch] = (src, d / f"{arch}-nvfp4.gguf")
    return out


def test_the_copy_is_nvfp4_with_the_metadata_kept(files):
    src, dst = files["qwen3moe"]
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    kinds = {t.name: t.tensor_type for t in b.tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.NVFP4
    assert kinds["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.NVFP4   # 3-D experts
    assert kinds["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32      # the router kept
    assert kinds["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert b.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_NVFP4
    for key in ("tokenizer.ggml.tokens", "qwen3moe.expert_count", "general.architecture"):
        assert b.fields[key].contents() == a.fields[key].contents()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_torch_runner_agrees_with_llama_cpp_on_the_nvfp4_file(files, arch):
    _, path = files[arch]
    cfg = EngineConfig(n_slots=1, n_ctx=512)
    ref_r, r = make_runner("llamacpp", cfg, path), make_runner("torch", cfg, path)
    try:
        ids = ref_r.tokenize(TEXT, add_special=True)[:N_TOKENS]
        agree, kl = agreement(teacher_forced(ref_r, ids), teacher_forced(r, ids))
        assert agree >= 0.93 and kl < 0.01, (agree, kl)
        # the start-up check passes on NVFP4 weights: speculation stays on
        assert check_exact(r, 0, ids[:100], k=8).exact
    finally:
        ref_r.close()
        r.close()


def test_report_and_json(files, tmp_path, capsys):
    src, _ = files["llama"]
    out = tmp_path / "q8.gguf"
    assert main(["quantize", "--to", "q8_0", str(src), str(out), "--report", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["converted"] == 16 and s["bytes_after"] < s["bytes_before"]
    # 8-bit blocks against float32: close, but not identical
    assert 0.9 <= s["argmax_agreement"] <= 1.0 and 0 < s["mean_kl"] < 0.01 and s["report_tokens"] > 100


def test_refusals(files, tmp_path, capsys):
    src, _ = files["llama"]
    with pytest.raises(QuantizeError, match="another file"):
        quantize_file(src, src, "nvfp4")
    with pytest.raises(QuantizeError, match="must be one of"):
        quantize_file(src, tmp_path / "x.gguf", "q2_k")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + np.arange(20, dtype=np.uint8).tobytes())
    assert main(["quantize", "--to", "nvfp4", str(bad), str(tmp_path / "y.gguf")]) == 2
    assert "not a readable GGUF" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists() and not (tmp_path / "y.gguf.part").exists()
    # llama.cpp's own quantizer (the K-quant mixes) refuses it as clearly, leaving nothing behind
    assert main(["quantize", "--to", "q4_k_m", str(bad), str(tmp_path / "k.gguf")]) == 2
    assert "not a readable GGUF" in capsys.readouterr().err
    assert not (tmp_path / "k.gguf").exists() and not (tmp_path / "k.gguf.part").exists()
