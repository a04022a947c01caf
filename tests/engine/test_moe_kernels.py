"""MoE layers on the grouped expert kernel (`runners/torch/grouped.py`, `kernels.moe_gemm`): the
torch runner with `--torch-kernels triton` keeps a Q8_0 model's experts as the file's blocks
and computes every routed (row, expert) pair in two launches a layer; with expert offload the
pool's slots go through the same kernel. Under Triton's interpreter on CPU this proves the
wiring against the same runner with the experts dequantized (the tiny qwen3moe and Mixtral
fixture, several streams in one forward), the start-up exactness check, and offload on the
kernel equal to all-resident on the kernel bit for bit.

On the qwen3moe fixture only (CI time: the interpreter took ~32 s more for Mixtral): the kernel
gets (row, expert) pairs and their weights, and what differs between the two architectures
(whether the router's top-k weights are renormalised) is torch code before it, which
test_expert_offload.py and test_torch_runner.py run on both."""
from __future__ import annotations

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
pytest.importorskip("triton")

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.spec.probe import check_exact  # noqa: E402
from appliance.quantize import quantize_file  # noqa: E402
from kernels import INTERPRET  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# float32 products under the interpreter; on a GPU the kernels' products are bfloat16 (2^-9 each)
TOL = 1e-4 if INTERPRET else 3e-2
IDS = [(i * 37) % 4000 + 5 for i in range(120)]


@pytest.fixture(scope="module", params=["qwen3moe"])
def files(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-kernels")
    src = write_tiny(d / f"{request.param}.gguf", request.param, n_layer=2, n_expert=8, n_expert_used=2)
    return src, quantize_file(src, d / f"{request.param}-q8.gguf", "q8_0").output


def runner(path, kernels: str, cache: str = "off", compute: str = "auto"):
    cfg = EngineConfig(engine="torch", n_slots=3, n_ctx=256, torch_dtype="float32", torch_device=DEVICE,
                       torch_kernels=kernels, expert_cache=cache, expert_compute=compute)
    return make_runner("torch", cfg, path)


def forwards(r) -> list[np.ndarray]:
    """A prompt chunk, then two streams and a decode row in one forward, then decode steps of
    three streams together: every logit row."""
    for s in range(3):
        r.truncate(s, 0)
    out = r.forward([Span(0, tuple(IDS[:48]), 0, 48)])
    out += r.forward([Span(1, tuple(IDS[50:70]), 0, 20), Span(2, tuple(IDS[70:75]), 0, 5),
                      Span(0, (IDS[48],), 48, 1)])
    for step in range(3):
        out += r.forward([Span(0, (IDS[80 + step],), 49 + step, 1), Span(1, (IDS[90 + step],), 20 + step, 1),
                          Span(2, (IDS[100 + step],), 5 + step, 1)])
    return out


def assert_kernel_matches(on, off) -> None:
    """Every logit row of `forwards` on the kernel against the runner without it; exact steps."""
    for a, b in zip(forwards(on), forwards(off)):
        # the kernel's sums against torch's matmuls, in other orders (and bf16 products on a GPU)
        assert np.abs(a - b).max() < TOL * np.abs(b).max()
        if INTERPRET:
            assert (a.argmax(-1) == b.argmax(-1)).all()
    assert check_exact(on, 1, IDS[:30], k=6).exact


def test_block_experts_on_the_kernel_match_the_dequantized_runner(files):
    _, q8 = files
    on, off = runner(q8, "triton"), runner(q8, "off")
    try:
        kernels = [b.ffn.kernel for b in on.model.blocks]
        assert all(k is not None and k.mats.fmt == "q8_0" for k in kernels)      # the file's blocks
        assert all(k.mats.gate_up.dtype.is_floating_point is False for k in kernels)
        assert all(b.ffn.kernel is None for b in off.model.blocks)
        assert_kernel_matches(on, off)
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_offload_on_the_kernel_equals_resident_on_the_kernel(files, tmp_path, arch):
    """Dense float32 experts (the F32 file): a 10-slot pool for 16 experts through the grouped
    kernel equals every expert resident on it bit for bit when the misses are copied in
    (`device`); misses computed on the host (`cpu`) take torch's matmul for their pairs.
    gpt-oss: each slot's biases copied with its matrices."""
    src = files[0] if arch == "qwen3moe" else write_tiny(tmp_path / "gpt-oss.gguf", arch, n_layer=2, n_expert=8,
                                                         n_expert_used=2)
    resident = runner(src, "triton")
    try:
        assert all(b.ffn.kernel is not None and b.ffn.kernel.mats.fmt is None for b in resident.model.blocks)
        want = forwards(resident)
        for compute in ("device", "cpu"):
            offload = runner(src, "triton", cache="10", compute=compute)
            try:
                assert offload.model.experts is not None and offload.model.experts.grouped
                got = forwards(offload)
                s = offload.expert_stats()
                assert 0 < s.hits < s.lookups
                for g, w in zip(got, want):
                    if compute == "device":
                        assert np.array_equal(g, w), np.abs(g - w).max()
                    else:
                        assert np.abs(g - w).max() < TOL * np.abs(w).max()
                assert (s.host_rows == 0) == (compute == "device")
                assert check_exact(offload, 1, IDS[:30], k=6).exact
            finally:
                offload.close()
    finally:
        resident.close()


def test_gpt_oss_mxfp4_experts_on_the_kernel_match_the_dequantized_runner(tmp_path):
    """gpt-oss's experts as its files hold them (MXFP4) stay blocks on the grouped kernel, with
    their biases and clamped SwiGLU between its two launches (each padded pair's expert from
    its tile); against the runner with them dequantized through torch ops."""
    path = write_tiny(tmp_path / "gpt-oss.gguf", "gpt-oss", n_layer=2, n_expert=8, n_expert_used=2, quant="MXFP4")
    on, off = runner(path, "triton"), runner(path, "off")
    try:
        assert all(b.ffn.kernel is not None and b.ffn.kernel.mats.fmt == "mxfp4" for b in on.model.blocks)
        assert all(b.ffn.kernel.mats.biases is not None for b in on.model.blocks)
        assert_kernel_matches(on, off)
    finally:
        on.close()
        off.close()
