"""The torch runner's CPU decode attention (`cpu_attention`, csrc/attend.cpp) against a float64
softmax(QK^T)V in plain torch, and the properties the runner's exactness rests on: a row's
result is the same alone or among 15 others, on 1 thread or 2, and never reads a key past its
own position. Then the runner's choice of path (`--torch-attention`)."""
from __future__ import annotations

import math

import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

import torch  # noqa: E402

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners.torch import cpu_attention  # noqa: E402
from appliance.errors import ModelLoadError  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402

N_CTX = 1100


@pytest.fixture(scope="module")
def attend():
    kernel, why = cpu_attention.load()
    assert kernel is not None, f"the kernel did not build on this machine: {why}"
    return kernel


def pool(g: int, e: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V of one slot as the pool holds them: [G, N_CTX, E] views of a larger
    tensor (another slot beside them), positions contiguous."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, g, N_CTX, e, generator=gen).to(dtype)
    v = torch.randn(2, g, N_CTX, e, generator=gen).to(dtype)
    return k[1], v[1]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    t, h, e = q.shape
    g = k.shape[0]
    rows = []
    for i in range(t):
        p = start + i
        qq = q[i].double().view(g, h // g, e) / math.sqrt(e)
        s = qq @ k[:, :p + 1].double().transpose(1, 2)
        rows.append((torch.softmax(s, -1) @ v[:, :p + 1].double()).reshape(-1))
    return torch.stack(rows)


SHAPES = [(2, 2, 16), (3, 3, 64), (1, 4, 128), (2, 1, 32)]   # KV heads, query heads per KV head, E
SPANS = [(0, 1), (5, 3), (254, 3), (255, 1), (256, 1), (511, 16), (1000, 5)]   # (start, rows)


@pytest.mark.parametrize("g,per,e", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_is_softmax_attention_over_each_rows_own_keys(attend, g, per, e, dtype):
    k, v = pool(g, e, dtype)
    gen = torch.Generator().manual_seed(1)
    for start, t in SPANS:
        q = torch.randn(t, g * per, e, generator=gen)
        got = attend(q, k, v, start, 1 / math.sqrt(e))
        want = reference(q, k, v, start)
        assert got.shape == (t, g * per * e) and got.dtype == torch.float32
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-6, (start, t, err)


def test_a_rows_bits_depend_on_its_position_alone(attend):
    """Alone or in a 16-row span, 1 thread or 2, keys past its position NaN or not."""
    k, v = pool(3, 64, torch.bfloat16)
    q = torch.randn(16, 9, 64, generator=torch.Generator().manual_seed(2))
    for start in (0, 250, 700):
        together = attend(q, k, v, start, 0.125)
        alone = torch.stack([attend(q[i:i + 1].contiguous(), k, v, start + i, 0.125)[0] for i in range(16)])
        assert torch.equal(alone, together)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(attend(q, k, v, start, 0.125), together)
        finally:
            torch.set_num_threads(threads)
        k2, v2 = k.clone(), v.clone()
        k2[:, start + 16:] = float("nan")
        v2[:, start + 16:] = float("nan")
        assert torch.equal(attend(q, k2, v2, start, 0.125), together)


def test_bad_shapes_are_refused_by_the_kernel(attend):
    k, v = pool(2, 64, torch.bfloat16)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="float32"):
        attend(q.double(), k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="past the KV"):
        attend(q, k, v, N_CTX, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        attend(torch.randn(1, 3, 64), k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        attend(q, k.transpose(1, 2), v.transpose(1, 2), 0, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        attend(q, k.half(), v.half(), 0, 0.125)


def test_shapes_the_kernel_cannot_take_are_named():
    assert cpu_attention.unsupported(9, 3, 64, torch.bfloat16) is None
    assert "head dim 8" in cpu_attention.unsupported(4, 2, 8, torch.float32)
    assert "float16" in cpu_attention.unsupported(4, 2, 64, torch.float16)
    assert "32 query heads on 1" in cpu_attention.unsupported(32, 1, 64, torch.float32)


def test_the_build_name_carries_what_the_machine_code_depends_on(monkeypatch):
    name = cpu_attention.build_name()
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: "sse2")
    assert cpu_attention.build_name() != name
    monkeypatch.setattr(cpu_attention.torch, "__version__", "0.0")
    assert cpu_attention.build_name() != name
    assert cpu_attention.cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == cpu_attention.Path("/x/appliance/torch_ext")
    assert cpu_attention.cache_dir({"XDG_CACHE_HOME": "rel", "HOME": "/h"}) == cpu_attention.Path("/h/.cache/appliance/torch_ext")


# -- the runner's choice ------------------------------------------------------------------------

def runner(tmp_path, attention: str, **dims):
    return make_runner("torch", EngineConfig(n_slots=1, n_ctx=256, torch_dtype="float32", torch_attention=attention),
                       write_tiny(tmp_path / "m.gguf", "llama", **dims))


def test_the_runner_takes_the_kernel_by_default_and_ops_when_asked(tmp_path):
    cpp, ops = runner(tmp_path, "auto"), runner(tmp_path, "ops")
    try:
        assert cpp.info.settings["attention"] == "cpp" and "attention_note" not in cpp.info.settings
        assert ops.info.settings["attention"] == "ops"
        assert cpp.model.blocks[0].attn.cpu is not None and ops.model.blocks[0].attn.cpu is None
        # a saved state of one path is not restored into the other: the next layer's K and V
        # come from the attention's output
        assert cpp.kv_fingerprint() != ops.kv_fingerprint()
    finally:
        cpp.close()
        ops.close()


def test_a_model_the_kernel_cannot_take_runs_on_ops_and_says_why(tmp_path):
    r = runner(tmp_path, "auto", n_embd=32, n_head=4)   # head dim 8
    try:
        assert r.info.settings["attention"] == "ops"
        assert "head dim 8" in r.info.settings["attention_note"]
    finally:
        r.close()
    with pytest.raises(ModelLoadError, match="head dim 8"):
        runner(tmp_path, "cpp", n_embd=32, n_head=4)


def test_a_kernel_that_does_not_build_leaves_ops_or_refuses_cpp(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_attention, "load", lambda: (None, "CalledProcessError: no compiler"))
    r = runner(tmp_path, "auto")
    try:
        assert r.info.settings["attention"] == "ops"
        assert r.info.settings["attention_note"] == "ops: CalledProcessError: no compiler"
    finally:
        r.close()
    with pytest.raises(ModelLoadError, match="no compiler"):
        runner(tmp_path, "cpp")
