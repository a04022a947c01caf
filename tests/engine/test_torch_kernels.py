"""The torch runner with `--torch-kernels triton`: its GGUF block matrices kept as stored and
multiplied by `kernels.wgemm`, its norms, Q/K norm + RoPE and decode attention on the fused
kernels (`runners/torch/fused.py`). On a machine without a GPU the kernels run under Triton's
interpreter on CPU tensors, so this proves the wiring (every stacked matrix, every format the
file holds, the start-up exactness check) against the same runner with the matrices
dequantized; a GPU run of the same file is in scripts/gpu_check.sh."""
from __future__ import annotations

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
triton = pytest.importorskip("triton")

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.spec.probe import check_exact  # noqa: E402
from appliance.errors import ModelLoadError  # noqa: E402
from appliance.quantize import quantize_file  # noqa: E402
from kernels import INTERPRET  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    src = write_tiny(d / "qwen3.gguf", "qwen3", n_layer=2)
    path = quantize_file(src, d / "qwen3-q8.gguf", "q8_0").output
    cfg = EngineConfig(n_slots=2, n_ctx=256, torch_dtype="float32", torch_device=DEVICE)
    on = make_runner("torch", EngineConfig(**{**cfg.__dict__, "torch_kernels": "triton"}), path)
    off = make_runner("torch", EngineConfig(**{**cfg.__dict__, "torch_kernels": "off"}), path)
    yield on, off
    on.close()
    off.close()


def test_the_block_matrices_go_to_the_kernel(runners):
    on, off = runners
    assert on.info.settings["kernels"] == "triton" and off.info.settings["kernels"] == "off"
    kinds = {type(m).__name__ for b in on.model.blocks for m in (b.attn.wqkv, b.attn.wo)}
    assert kinds == {"BlockLinear"}
    assert all(b.attn.fused is not None for b in on.model.blocks)
    assert all(b.attn.fused is None for b in off.model.blocks)
    assert on.kv_fingerprint() != off.kv_fingerprint()   # other kernels, other KV bits


def test_logits_equal_the_dequantized_runner(runners):
    on, off = runners
    ids = list(range(100, 140))
    a = on.forward([Span(0, tuple(ids), 0, len(ids))])[0]
    b = off.forward([Span(0, tuple(ids), 0, len(ids))])[0]
    # float32 both ways: the kernel's IEEE dot against torch's matmul, summed in other orders
    assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_decode_steps_equal_the_torch_path(runners):
    """Steps of one row (the fused decode attention, qk norm + RoPE, RMSNorm) after a prompt."""
    on, off = runners
    ids = list(range(300, 330))
    for r in (on, off):
        r.truncate(1, 0)
        r.forward([Span(1, tuple(ids), 0, 1)])
    for i, tok in enumerate((5, 77, 901)):
        a = on.forward([Span(1, (tok,), len(ids) + i, 1)])[0]
        b = off.forward([Span(1, (tok,), len(ids) + i, 1)])[0]
        assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()


def test_exactness_check_passes_with_the_kernels(runners):
    on, _ = runners
    assert check_exact(on, 1, list(range(200, 230)), k=6).exact


def test_triton_refused_where_it_cannot_launch(tmp_path, monkeypatch):
    import kernels._triton as kt

    monkeypatch.setattr(kt, "INTERPRET", False)
    src = write_tiny(tmp_path / "llama.gguf", "llama", n_layer=1)
    with pytest.raises(ModelLoadError, match="no Triton launch"):
        make_runner("torch", EngineConfig(n_slots=1, n_ctx=128, torch_kernels="triton", torch_device="cpu"), src)


def test_gemm_configs_come_from_the_plan_and_misses_are_recorded(tmp_path):
    """No plan: every shape misses, runs on the default config, and is written once to the
    plan's misses file for `appliance tune --gemm`; a plan holding a shape's entries is used."""
    import torch

    from appliance.engine import plan as plan_mod
    from appliance.engine.runners.torch.runner import TunedGemm
    from kernels.plan import GemmEntry, GemmKey, GemmTable, gemm_fingerprint
    from kernels.wgemm import GemmConfig

    plan, device = tmp_path / "plan.json", torch.device(DEVICE)
    cfg = EngineConfig(plan=str(plan), torch_kernels="triton", torch_device=DEVICE)
    g = TunedGemm(cfg, device)
    for _ in range(2):
        assert g("q8_0", 64, 128, 1) == g.default
        g.record_misses()
    assert plan_mod.gemm_misses(plan) == [{"op": "wgemm", "fmt": "q8_0", "n": 64, "k": 128, "bucket": "1-16"}]
    chosen = GemmConfig(block_m=16, block_n=32, block_k=64)
    table = GemmTable(gemm_fingerprint(device),
                      {GemmKey("wgemm", "q8_0", 64, 128): {"1-16": GemmEntry(chosen, median_us=1.0, max_rel_err=0.0)}})
    plan.write_text(plan_mod.Plan(fingerprint={}, llamacpp={}, gemm=table.to_json()).to_json())
    assert TunedGemm(cfg, device)("q8_0", 64, 128, 3) == chosen


def test_a_k_quant_file_keeps_its_blocks_on_the_kernel(tmp_path):
    """A real Q4_K_M mix from llama.cpp's quantizer: its Q4_K and Q6_K matrices stay as the file's
    blocks on `kernels.wgemm` (a layer's Q4_K Q and K beside its Q6_K V as a stack of both), and
    the logits equal the dequantized runner's."""
    from appliance.engine.runners.torch import qlinear
    from appliance.quantize import llama_quantize

    src = write_tiny(tmp_path / "f32.gguf", "llama", n_embd=256, n_head=4, n_ff=512)
    path = tmp_path / "q4km.gguf"
    llama_quantize(src, path, "q4_k_m")
    cfg = EngineConfig(n_slots=1, n_ctx=64, torch_dtype="float32", torch_device=DEVICE)
    on = make_runner("torch", EngineConfig(**{**cfg.__dict__, "torch_kernels": "triton"}), path)
    off = make_runner("torch", EngineConfig(**{**cfg.__dict__, "torch_kernels": "off"}), path)
    try:
        fmts = set()
        for b in on.model.blocks:
            for m in (b.attn.wqkv, b.attn.wo, b.ffn.gate_up, b.ffn.down):
                parts = m.parts if isinstance(m, qlinear.StackedLinear) else [m]
                assert all(isinstance(p, qlinear.BlockLinear) for p in parts), type(m)
                fmts |= {p.fmt for p in parts}
        assert {"q4_k", "q6_k"} <= fmts
        assert any(isinstance(b.attn.wqkv, qlinear.StackedLinear) for b in on.model.blocks)
        ids = tuple(range(100, 120))
        a = on.forward([Span(0, ids, 0, len(ids))])[0]
        b = off.forward([Span(0, ids, 0, len(ids))])[0]
        assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()
        assert (a.argmax(-1) == b.argmax(-1)).all()
    finally:
        on.close()
        off.close()
