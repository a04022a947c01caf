"""Decode steps as CUDA graphs (`runners/torch/graphs.py`, `--torch-graphs`). On a CPU the
fixed-shape step runs uncaptured (`eager`) under Triton's interpreter: its logits and KV equal
the ordinary forward's bit for bit (tiny qwen3, Q8_0) for 1, 2 and 3 streams (3 padded to the bucket of 4, the
padding row writing the pool's spare slot), the start-up exactness check passes with steps
through it and verify rows through the forward, and the modes resolve as documented. On a GPU
(`gpu` mark) the graphs are captured and replay the same bits as the eager step."""
from __future__ import annotations

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
pytest.importorskip("triton")

import torch  # noqa: E402

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.runners.torch.graphs import buckets  # noqa: E402
from appliance.engine.runners.torch.runner import graph_mode  # noqa: E402
from appliance.engine.spec.probe import check_exact  # noqa: E402
from appliance.quantize import quantize_file  # noqa: E402
from kernels import INTERPRET  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
IDS = [(i * 41) % 3000 + 9 for i in range(100)]


@pytest.fixture(scope="module", params=["qwen3"])   # Q/K norms and RoPE on the fused kernel
def path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs")
    return quantize_file(write_tiny(d / f"{request.param}.gguf", request.param), d / "q8.gguf", "q8_0").output


def runner(path, graphs: str):
    return make_runner("torch", EngineConfig(n_slots=3, n_ctx=256, torch_dtype="float32", torch_device=DEVICE,
                                             torch_kernels="triton", torch_graphs=graphs), path)


def steps(r) -> list[np.ndarray]:
    """Prompts in three slots, then decode steps of 1, 2 and 3 streams: every logit row."""
    for s in range(3):
        r.truncate(s, 0)
        r.forward([Span(s, tuple(IDS[s * 20:s * 20 + 17 + s]), 0, 1)])
    out, pos = [], [17, 18, 19]
    for n in (1, 2, 3, 3):
        spans = [Span(s, (IDS[60 + 3 * len(out) + s],), pos[s], 1) for s in range(n)]
        out += r.forward(spans)
        pos = [p + 1 if s < n else p for s, p in enumerate(pos)]
    return out


def test_the_fixed_shape_step_equals_the_forward(path):
    eager, plain = runner(path, "eager"), runner(path, "off")
    try:
        assert eager.info.settings["graphs"] == "eager" and plain.info.settings["graphs"] == "off"
        assert eager.info.settings["graph_buckets"] == [1, 2, 4]
        for a, b in zip(steps(eager), steps(plain)):
            assert np.array_equal(a, b), np.abs(a - b).max()
        assert eager.graphs.steps == 4 and plain.graphs is None   # the decode steps went through it
        for slot in range(3):   # the same KV, and the same lengths
            assert eager.save(slot) == plain.save(slot)
        assert check_exact(eager, 0, IDS[:30], k=6).exact
    finally:
        eager.close()
        plain.close()


def test_modes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_mode("auto", True, False, cuda) == "capture"
    assert graph_mode("auto", True, False, cpu) == "off"
    assert graph_mode("eager", True, False, cpu) == "eager"
    assert graph_mode("auto", True, True, cuda) == "off"        # a MoE layer routes on the host
    assert graph_mode("eager", False, False, cpu) == "off"      # graphs need the kernels
    assert graph_mode("off", True, False, cuda) == "off"
    assert buckets(1) == (1,) and buckets(4) == (1, 2, 4) and buckets(5) == (1, 2, 4, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_graphs_are_captured_and_replay_the_eager_bits(path):
    captured, eager = runner(path, "auto"), runner(path, "eager")
    try:
        assert captured.info.settings["graphs"] == "captured", captured.info.settings["graphs_note"]
        for a, b in zip(steps(captured), steps(eager)):
            assert np.array_equal(a, b), np.abs(a - b).max()
        assert check_exact(captured, 0, IDS[:30], k=6).exact
    finally:
        captured.close()
        eager.close()
