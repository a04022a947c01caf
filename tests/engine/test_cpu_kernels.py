"""The torch runner's CPU kernels (`cpu_kernels`, csrc/cpu_kernels.cpp): the decode attention
against a float64 softmax(QK^T)V in plain torch, RMSNorm, RoPE and SwiGLU against torch's ops,
and the properties the runner's exactness rests on: a row's result is the same alone or among
others, on 1 thread or 2, and attention never reads a key past its own position. Then the
runner's choice of path (`--torch-cpu-kernels`)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

import torch  # noqa: E402

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.runners.torch import cpu_kernels  # noqa: E402
from appliance.errors import ModelLoadError  # noqa: E402

from .gguf_fixtures import random_blocks, write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402

N_CTX = 1100


@pytest.fixture(scope="module")
def mod():
    built, why = cpu_kernels.load()
    assert built is not None, f"the kernels did not build on this machine: {why}"
    return built


@pytest.fixture(scope="module")
def attend(mod):
    return mod.attend


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
    assert cpu_kernels.unsupported(9, 3, 64, torch.bfloat16) is None
    assert "head dim 8" in cpu_kernels.unsupported(4, 2, 8, torch.float32)
    assert "float16" in cpu_kernels.unsupported(4, 2, 64, torch.float16)
    assert "32 query heads on 1" in cpu_kernels.unsupported(32, 1, 64, torch.float32)


def test_the_build_name_carries_what_the_machine_code_depends_on(monkeypatch):
    name = cpu_kernels.build_name()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "sse2")
    assert cpu_kernels.build_name() != name
    monkeypatch.setattr(cpu_kernels.torch, "__version__", "0.0")
    assert cpu_kernels.build_name() != name
    assert cpu_kernels.cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == cpu_kernels.Path("/x/appliance/torch_ext")
    assert cpu_kernels.cache_dir({"XDG_CACHE_HOME": "rel", "HOME": "/h"}) == cpu_kernels.Path("/h/.cache/appliance/torch_ext")


# -- RMSNorm, RoPE, SwiGLU ------------------------------------------------------------------------

def rows_alone_equal_rows_together(fn, x: torch.Tensor) -> None:
    """fn's rows are the same bits computed alone, among all, and on 1 thread."""
    together = fn(x)
    alone = torch.cat([fn(x[i:i + 1].clone()) for i in range(x.shape[0])])
    assert torch.equal(alone, together)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(fn(x), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("c", [576, 64, 40])   # a multiple of 16 and a tail of 8
def test_rms_norm_is_torchs_row_by_row(mod, c):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(70, c, generator=gen) * 3, torch.randn(c, generator=gen)
    want = torch.nn.functional.rms_norm(x.double(), (c,), w.double(), 1e-5)
    got = mod.rms_norm(x, w, 1e-5, False)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # bfloat16 out: the float32 result rounded as torch rounds it
    assert torch.equal(mod.rms_norm(x, w, 1e-5, True), got.to(torch.bfloat16))
    # rows strided in a larger tensor (a view of the residual stream)
    wide = torch.randn(70, c + 16, generator=gen)
    assert torch.equal(mod.rms_norm(wide[:, :c], w, 1e-5, False), mod.rms_norm(wide[:, :c].contiguous(), w, 1e-5, False))
    rows_alone_equal_rows_together(lambda t: mod.rms_norm(t, w, 1e-5, False), x)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("e,dim", [(64, 64), (64, 32)])   # the whole head or a part rotated
@pytest.mark.parametrize("scaling", ["none", "yarn"])     # YaRN: angles blended by pair, cos and sin x 1.14
def test_rope_in_place_is_the_complex_rotation(mod, neox, e, dim, scaling):
    from appliance.engine.runners.torch.model import Rope
    from appliance.rope import RopeScaling

    class Args:
        rope_dim = dim
        rope = RopeScaling(kind=scaling, freq_base=10000.0, freq_scale=0.25 if scaling == "yarn" else 1.0,
                           orig_ctx=1024, ext_factor=1.0 if scaling == "yarn" else 0.0, attn_factor=1.0,
                           beta_fast=32.0, beta_slow=1.0)

        class spec:
            rope = "neox" if neox else "norm"

    rope = Rope(Args, None, "cpu")
    positions = torch.tensor([0, 1, 5, 300, 4095])
    rot = rope.tables(positions)
    x = torch.randn(5, 7, e, generator=torch.Generator().manual_seed(4))
    want = rope(x.clone(), rot)
    qkv = torch.cat((x, torch.randn(5, 2, e)), 1)     # rotated in place inside a larger tensor
    got = mod.rope_(qkv[:, :7], torch.view_as_real(rot[:, 0]), dim, neox)
    assert got is None and torch.allclose(qkv[:, :7], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, :7, dim:], x[..., dim:])

    together = x.clone()
    mod.rope_(together, torch.view_as_real(rot[:, 0]), dim, neox)
    for i in range(5):                                  # a row alone: the same bits
        row = x[i:i + 1].clone()
        mod.rope_(row, torch.view_as_real(rot[i:i + 1, 0]), dim, neox)
        assert torch.equal(row, together[i:i + 1])


@pytest.mark.parametrize("f", [1536, 40])
def test_swiglu_is_silu_gate_times_up(mod, f):
    gen = torch.Generator().manual_seed(5)
    gu = torch.randn(33, 2 * f, generator=gen) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])      # no overflow at either end
    gate, up = gu.double().chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    got = mod.swiglu(gu, False)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(mod.swiglu(gu, True), got.to(torch.bfloat16))
    rows_alone_equal_rows_together(lambda t: mod.swiglu(t, False), gu)


def test_bad_inputs_are_refused_by_the_small_kernels(mod):
    with pytest.raises(RuntimeError, match="float32"):
        mod.rms_norm(torch.randn(2, 16).double(), torch.randn(16), 1e-5, False)
    with pytest.raises(RuntimeError, match="w must be"):
        mod.rms_norm(torch.randn(2, 16), torch.randn(8), 1e-5, False)
    with pytest.raises(RuntimeError, match="rot must be"):
        mod.rope_(torch.randn(2, 3, 16), torch.randn(1, 8, 2), 16, False)
    with pytest.raises(RuntimeError, match="2F"):
        mod.swiglu(torch.randn(2, 15), False)


# -- the runner's choice ------------------------------------------------------------------------

def runner(tmp_path, setting: str, **dims):
    return make_runner("torch", EngineConfig(n_slots=1, n_ctx=256, torch_dtype="float32", torch_cpu_kernels=setting),
                       write_tiny(tmp_path / "m.gguf", "llama", **dims))


# -- the int4 matmul --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4(mod):
    """The int4 matmul: AVX512-BF16 where the CPU has it, else the portable loop of the same
    arithmetic (the runner multiplies with torch's kernel there, but the layout and the
    formula are the same)."""
    return mod


def int4_matrix(qtype, n: int, k: int, seed: int):
    import gguf

    from appliance.engine.runners.torch import qlinear
    from appliance.engine.runners.torch.weights import QuantBlocks

    if qtype in (gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K):   # gguf cannot quantize them
        blocks = QuantBlocks(random_blocks(qtype, n, k, seed), qtype, (n, k))
    else:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        blocks = QuantBlocks(gguf.quants.quantize(w, qtype), qtype, (n, k))
    lin = qlinear.Int4Linear(blocks, torch.bfloat16)
    codes, scale, zero = (qlinear.split_q8_0 if lin.doubled else qlinear.unpack)(blocks)
    # the weights the kernel holds: the file's codes, each group's scale and zero in bfloat16
    s, z = (torch.from_numpy(a).to(torch.bfloat16).double().numpy() for a in (scale, zero))
    dense = (codes.astype(np.float64) - 8) * np.repeat(s, lin.group, 1) + np.repeat(z, lin.group, 1)
    if lin.doubled:
        dense = dense[:, :k] + dense[:, k:]
    return lin, torch.from_numpy(dense)


@pytest.mark.parametrize("qtype_name,n,k", [("Q4_0", 48, 96), ("Q4_1", 64, 576), ("Q8_0", 32, 128),
                                            ("Q5_0", 48, 96), ("Q5_1", 32, 576), ("Q5_K", 48, 512), ("Q6_K", 32, 768)])
def test_the_int4_matmul_is_the_packed_matrix_times_x(int4, qtype_name, n, k):
    """Against float64 on the very weights it holds (the codes, bfloat16 scales and zeros):
    only float32 sums apart; Q8_0 as its two int4 halves, Q5_x and Q6_K with their codes' fifth
    and sixth bits from the second plane (Q6_K's scales per 16 weights)."""
    import gguf

    lin, dense = int4_matrix(getattr(gguf.GGMLQuantizationType, qtype_name), n, k, seed=4)
    lin.use(int4)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(5))
    got = lin(x)
    want = x.to(torch.bfloat16).double() @ dense.T
    assert got.dtype == torch.float32 and got.shape == (11, n)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    if lin.bits > 4:       # without the kernels: a bfloat16 copy of those weights
        lin.use(None)
        assert lin.layout == "dense" and ((lin(x).double() - want).norm() / want.norm()).item() < 0.01


def test_an_int4_rows_bits_depend_on_that_row_alone(int4):
    """A row alone, among 5, 9 (past the 8 rows a dequantized group serves) or 40 rows, on 1
    thread or 2: the same bits, so a verify equals its steps and a prompt row its chunk."""
    import gguf

    for qtype, k in ((gguf.GGMLQuantizationType.Q4_1, 576), (gguf.GGMLQuantizationType.Q6_K, 512)):
        lin, _ = int4_matrix(qtype, 96, k, seed=6)
        lin.use(int4)
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(7))
        together = lin(x)
        for rows in (1, 5, 9):
            assert torch.equal(lin(x[:rows]), together[:rows])
        rows_alone_equal_rows_together(lin, x)


def test_the_int4_matmul_refuses_what_it_cannot_read(int4):
    import gguf

    lin, _ = int4_matrix(gguf.GGMLQuantizationType.Q4_0, 32, 64, seed=8)
    lin.use(int4)
    with pytest.raises(RuntimeError, match="K"):
        int4.int4_matmul(torch.zeros(2, 96, dtype=torch.bfloat16), lin.packed, lin.scales_zeros)
    with pytest.raises(RuntimeError, match="bfloat16"):
        int4.int4_matmul(torch.zeros(2, 64), lin.packed, lin.scales_zeros)
    with pytest.raises(RuntimeError, match="4, 5 or 6 bits"):
        int4.quant_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), lin.packed, lin.packed, lin.scales_zeros, 3, 32)
    with pytest.raises(RuntimeError, match="high must be"):   # a fifth bit's plane missing
        int4.quant_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), lin.packed, lin.packed, lin.scales_zeros, 1, 32)


def test_the_runner_takes_the_kernels_by_default_and_ops_when_asked(tmp_path):
    cpp, ops = runner(tmp_path, "auto"), runner(tmp_path, "ops")
    try:
        assert cpp.info.settings["cpu_kernels"] == "cpp" and cpp.info.settings["attention"] == "cpp"
        assert "cpu_kernels_note" not in cpp.info.settings
        assert ops.info.settings["cpu_kernels"] == "ops" and ops.info.settings["attention"] == "ops"
        block = cpp.model.blocks[0]
        assert block.attn.cpu is not None and block.ffn.act is not None and cpp.model.rope.cpu is not None
        block = ops.model.blocks[0]
        assert block.attn.cpu is None and block.ffn.act is None and ops.model.rope.cpu is None
        # a saved state of one path is not restored into the other: the next layer's K and V
        # come from the kernels' outputs
        assert cpp.kv_fingerprint() != ops.kv_fingerprint()
        # both compute the same model: the logits of a short prompt agree closely
        ids = cpp.tokenize("The quick brown fox jumps over the lazy dog", add_special=True)
        a = cpp.forward([Span(0, tuple(ids), 0, len(ids))])[0]
        b = ops.forward([Span(0, tuple(ids), 0, len(ids))])[0]
        assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(b).max())
    finally:
        cpp.close()
        ops.close()


def test_a_model_the_attention_cannot_take_keeps_the_other_kernels_and_says_why(tmp_path):
    r = runner(tmp_path, "auto", n_embd=32, n_head=4)   # head dim 8
    try:
        assert r.info.settings["cpu_kernels"] == "cpp" and r.info.settings["attention"] == "ops"
        assert "head dim 8" in r.info.settings["cpu_kernels_note"]
        assert r.model.blocks[0].attn.cpu is None and r.model.blocks[0].ffn.act is not None
    finally:
        r.close()
    with pytest.raises(ModelLoadError, match="head dim 8"):
        runner(tmp_path, "cpp", n_embd=32, n_head=4)


def test_kernels_that_do_not_build_leave_ops_or_refuse_cpp(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: (None, "CalledProcessError: no compiler"))
    r = runner(tmp_path, "auto")
    try:
        assert r.info.settings["cpu_kernels"] == "ops" and r.info.settings["attention"] == "ops"
        assert r.info.settings["cpu_kernels_note"] == "ops: CalledProcessError: no compiler"
    finally:
        r.close()
    with pytest.raises(ModelLoadError, match="no compiler"):
        runner(tmp_path, "cpp")


def test_a_build_killed_midway_does_not_hang_the_next_load(mod):
    """torch's build lock is a file: one left by a killed build is cleared, not waited on."""
    import threading

    name = cpu_kernels.build_name()
    (cpu_kernels.cache_dir() / name / "lock").write_text("")
    got = []
    t = threading.Thread(target=lambda: got.append(cpu_kernels._build(name)), daemon=True)
    t.start()
    t.join(120)
    assert got and got[0][0] is not None, got
    assert not (cpu_kernels.cache_dir() / name / "lock").exists()


def test_a_prefetched_build_is_the_one_load_waits_for(monkeypatch):
    """The runner starts the build first thing; its load() then waits for that build rather
    than starting a second one, and gets its result."""
    import threading
    import time

    calls, release = [], threading.Event()

    def slow_build(name):
        calls.append(threading.current_thread().name)
        release.wait(30)
        return "module", ""

    monkeypatch.setattr(cpu_kernels, "_build", slow_build)
    monkeypatch.setattr(cpu_kernels, "build_name", lambda: "appliance_cpu_kernels_prefetch_test")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_building", {})
    cpu_kernels.prefetch()
    cpu_kernels.prefetch()                     # a second call starts nothing more
    got = []
    waiter = threading.Thread(target=lambda: got.append(cpu_kernels.load()), daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert not got, "load() returned before the build it waits for finished"
    release.set()
    waiter.join(30)
    assert got == [("module", "")] and calls == ["cpu-kernels-build"]
    assert cpu_kernels.load() == ("module", "") and len(calls) == 1


def test_the_one_call_span_is_the_same_bits_as_its_steps_one_by_one(tmp_path):
    """attend_span (RoPE, KV store, attention in one call) against rope_, KVPool.write and
    attend called one by one: logits and the stored KV equal, for a step and a verify."""
    r = runner(tmp_path, "auto")
    try:
        ids = tuple(r.tokenize("The quick brown fox jumps over the lazy dog, again and again", add_special=True))
        blocks = r.model.blocks
        assert all(b.attn.span is not None for b in blocks)
        got = {}
        for one_call in (True, False):
            for b in blocks:
                b.attn.span = r.model.blocks[0].attn.span if one_call else None
            r.truncate(0, 0)
            prompt = r.forward([Span(0, ids[:-5], 0, 1)])[0]
            step = r.forward([Span(0, ids[-5:-4], len(ids) - 5, 1)])[0]
            verify = r.forward([Span(0, ids[-4:], len(ids) - 4, 4)])[0]
            got[one_call] = (prompt, step, verify, r.save(0))
        for a, b in zip(got[True], got[False]):
            assert (a == b) if isinstance(a, bytes) else np.array_equal(a, b)
    finally:
        r.close()
