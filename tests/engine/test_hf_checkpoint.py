"""Hugging Face checkpoint directories on the torch runner (`runners/torch/hf.py`, `hf_vocab.py`):
an NVIDIA ModelOpt NVFP4 checkpoint written from an NVFP4 GGUF (`hf_fixtures.write_modelopt`:
the same values, ModelOpt's layout, a tensor scale of 2^-4, llama's Q/K rows in HF's order)
gives logits equal bit for bit to the same runner on the GGUF, agrees with llama.cpp on the
GGUF as the GGUF does, and tokenizes as both Hugging Face's `tokenizers` and the GGUF's own
vocabulary do. With the kernels on (the interpreter here), the NVFP4 matrices stay as blocks
and the tensor scale is applied to the output."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners import make_runner as make_any_runner  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.runners.torch import hf_vocab  # noqa: E402
from appliance.errors import ModelLoadError  # noqa: E402
from appliance.models import resolve  # noqa: E402
from appliance.quantize import agreement, quantize_file, teacher_forced  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .hf_fixtures import write_modelopt  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402
from .test_torch_runner import N_TOKENS, TEXT  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3moe")   # Q/K rows permuted; q/k/v biases; experts and q/k norms


@pytest.fixture(autouse=True)
def data_dir(tmp_path_factory, monkeypatch):
    """The converted vocabularies go to a temporary data directory, shared by the module."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        src = write_tiny(d / f"{arch}.gguf", arch, n_layer=2, n_expert=4, n_expert_used=2)
        nv = quantize_file(src, d / f"{arch}-nvfp4.gguf", "nvfp4").output
        out[arch] = (nv, write_modelopt(nv, d / f"{arch}-modelopt", arch))
    return out


def runner(path, **kw):
    return make_runner("torch", EngineConfig(**{"n_slots": 2, "n_ctx": 256, "torch_dtype": "float32", **kw}), path)


def logits(r) -> list[np.ndarray]:
    ids = [(i * 53) % 3000 + 17 for i in range(40)]
    r.truncate(0, 0)
    out = r.forward([Span(0, tuple(ids[:36]), 0, 36)])
    for i, tok in enumerate(ids[36:]):
        out += r.forward([Span(0, (tok,), 36 + i, 1)])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_checkpoint_computes_what_the_gguf_computes(checkpoints, arch):
    gguf_path, hf_path = checkpoints[arch]
    a, b = runner(gguf_path), runner(hf_path)
    try:
        assert b.info.arch == a.info.arch and b.info.n_vocab == a.info.n_vocab
        assert b.info.chat_template == a.info.chat_template and b.info.eog_ids == a.info.eog_ids
        for x, y in zip(logits(a), logits(b)):
            assert np.array_equal(x, y), np.abs(x - y).max()
    finally:
        a.close()
        b.close()


def test_agreement_with_llama_cpp_on_the_gguf(checkpoints):
    """llama.cpp reads the GGUF; the torch runner the checkpoint (HF's Q/K row order undone)."""
    gguf_path, hf_path = checkpoints["llama"]
    ref, r = make_runner("llamacpp", EngineConfig(n_slots=1, n_ctx=512), gguf_path), runner(hf_path, n_ctx=512)
    try:
        ids = ref.tokenize(TEXT, add_special=True)[:N_TOKENS]
        agree, kl = agreement(teacher_forced(ref, ids), teacher_forced(r, ids))
        assert agree >= 0.93 and kl < 0.01, (agree, kl)
    finally:
        ref.close()
        r.close()


def test_the_tokenizer_is_converted_faithfully(checkpoints, tmp_path):
    gguf_path, hf_path = checkpoints["qwen2"]
    assert hf_vocab.candidates(hf_path)[0] == "smollm"       # suggested by its pre_tokenizer
    hf_tok = tokenizers.Tokenizer.from_file(str(hf_path / "tokenizer.json"))
    a, b = runner(gguf_path), runner(hf_path)
    try:
        for text in (hf_vocab.PROBE, TEXT[:2000], "<|im_start|>user\nHi 12345<|im_end|>"):
            # Hugging Face matches added special tokens in any text, llama.cpp when asked to
            assert b.tokenize(text, add_special=False, parse_special=True) == hf_tok.encode(
                text, add_special_tokens=False).ids
            assert b.tokenize(text, add_special=False) == a.tokenize(text, add_special=False)
            ids = b.tokenize(text, add_special=False)
            assert b.detokenize(ids) == text.encode()
    finally:
        a.close()
        b.close()


def test_a_tokenizer_no_pre_tokenizer_matches_is_refused(checkpoints, tmp_path, monkeypatch):
    """Whitespace split only, no BPE regex: llama.cpp has no pre-tokenizer that splits so (three
    candidates tried here, to keep the test short)."""
    monkeypatch.setattr(hf_vocab, "PRE", ("llama-bpe", "qwen2", "smollm"))
    _, hf_path = checkpoints["qwen2"]
    d = shutil.copytree(hf_path, tmp_path / "odd")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                      "use_regex": False}]}
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    with pytest.raises(ModelLoadError, match="none of llama.cpp's pre-tokenizers"):
        runner(d)


def test_kernels_keep_nvfp4_blocks_and_apply_the_tensor_scale(checkpoints):
    pytest.importorskip("triton")
    from kernels import INTERPRET

    device = "cpu" if INTERPRET else "cuda"
    _, hf_path = checkpoints["llama"]
    on, off = runner(hf_path, torch_kernels="triton", torch_device=device), runner(hf_path)
    try:
        kept = [b.attn.wqkv for b in on.model.blocks]
        assert all(type(m).__name__ == "BlockLinear" and m.fmt == "nvfp4" for m in kept)
        assert all(m.row_scale is not None and float(m.row_scale[0]) == 2.0 ** -4 for m in kept)
        tol = 1e-4 if INTERPRET else 3e-2        # bf16 products on a GPU
        for x, y in zip(logits(on), logits(off)):
            assert np.abs(x - y).max() < tol * np.abs(y).max()
    finally:
        on.close()
        off.close()


def test_resolve_and_refusals(checkpoints, tmp_path):
    _, hf_path = checkpoints["llama"]
    ref = resolve(str(hf_path))
    assert ref.path == hf_path.resolve() and ref.alias == hf_path.name
    with pytest.raises(ModelLoadError, match="torch runner"):
        make_any_runner(EngineConfig(n_slots=1, n_ctx=128), hf_path, "x")
    with pytest.raises(ModelLoadError, match="not a Hugging Face checkpoint"):
        resolve(str(tmp_path))
    d = shutil.copytree(hf_path, tmp_path / "fp8")
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ModelLoadError, match="'FP8' is not supported"):
        runner(d)


def test_served_through_the_engine_like_its_gguf(checkpoints):
    """The whole engine on the checkpoint: the chat template from tokenizer_config.json, greedy
    replies equal to the engine on the GGUF's."""
    import uuid

    from appliance.engine.loop import EngineLoop
    from web import wire

    from .test_speculate_identity import run

    def loop(path) -> EngineLoop:
        return EngineLoop(EngineConfig(model=str(path), engine="torch", n_ctx=256, n_slots=2, plan="off",
                                       cache_disk_bytes=0, torch_dtype="float32"))

    def chat(text):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
        return wire.parse_chat(body, uuid.uuid4().hex, {"m"}, 256).request

    gguf_path, hf_path = checkpoints["qwen3moe"]
    a, b = loop(gguf_path), loop(hf_path)
    try:
        assert b.info.arch == "qwen3moe" and b.info.chat_template == a.info.chat_template
        prompts = ["The lighthouse keeper climbed the stairs", "1, 2, 3, 4"]
        assert [t for t, _ in run(b, [chat(p) for p in prompts])] == [t for t, _ in run(a, [chat(p) for p in prompts])]
    finally:
        a.runner.close()
        b.runner.close()
