"""kernels.norm_rope: the references against the torch runner's own rms_norm and Rope, the
Triton kernels against the references (under the interpreter on CPU, compiled on a GPU), and
bad input refused.

Tolerance: float32 all the way (half inputs are upcast exactly on load), so kernel and
reference differ only by summation order and rounding: max abs error <= 1e-6 x the largest
magnitude of the expected values (2e-6 on a GPU, where FMAs contract and rsqrt differs)."""
import math
from types import SimpleNamespace

import pytest
import torch

from appliance.rope import RopeScaling
from kernels import norm_rope as nr
from kernels._triton import INTERPRET, available

DEV = "cpu" if INTERPRET else "cuda"   # the interpreter runs CPU tensors; compiled, CUDA ones


@pytest.fixture
def dev():
    pytest.importorskip("triton")
    if not available(DEV):
        pytest.skip(f"no Triton kernels for {DEV} tensors here")
    return DEV


def assert_near(got, want, rel=1e-6):
    assert got.dtype == torch.float32 and got.shape == want.shape
    err, scale = (got - want).abs().max().item(), max(1.0, want.abs().max().item())
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel:g} x {scale:.3g}"


def inv_freq(rope_dim, base=1e4, scale=1.0):          # as Rope.__init__ computes it
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    return scale * base ** (-i / rope_dim)


def qk_case(n, h, g, e, rope_dim, norm, device="cpu", seed=0):
    """qk as the runner has it, a view of the stacked QKV rows (rows and heads strided)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, h + 2 * g, e, generator=gen)
    pos = torch.randint(0, 8192, (n,), generator=gen)
    cos, sin = nr.rope_tables(pos, inv_freq(rope_dim))
    weights = (1 + 0.5 * torch.randn(e, generator=gen), 1 + 0.5 * torch.randn(e, generator=gen)) if norm else (None, None)
    to = lambda t: None if t is None else t.to(device)
    return to(qkv)[:, :h + g], to(cos), to(sin), to(weights[0]), to(weights[1])


# --------------------------------------------------------------- references vs the runner

def rope_args(kind, rope_dim, base=1e4, scale=1.0, scaling="linear"):
    """The model's args for Rope: `scaling` linear (every pair x scale) or yarn (blended by pair,
    cos and sin scaled by 1 + 0.1 ln(1 / scale)), trained at 4096 positions."""
    r = RopeScaling(kind=scaling, freq_base=base, freq_scale=scale, orig_ctx=4096,
                    ext_factor=1.0 if scaling == "yarn" else 0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)
    return SimpleNamespace(spec=SimpleNamespace(rope=kind), rope_dim=rope_dim, rope=r)


def test_rms_norm_torch_is_the_models():
    from appliance.engine.runners.torch.model import rms_norm
    x, w = torch.randn(7, 576), torch.randn(576)
    assert torch.equal(nr.rms_norm_torch(x, w, 1e-5), rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("kind", nr.KINDS)
@pytest.mark.parametrize("freqs", [False, True])
@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_rope_tables_are_the_models(kind, freqs, scaling):
    from appliance.engine.runners.torch.model import Rope
    factors = torch.linspace(1, 8, 32) if freqs else None           # Llama 3's rope_freqs
    rope = Rope(rope_args(kind, 64, base=5e5, scale=0.25, scaling=scaling), factors, "cpu")
    assert rope.magnitude == (1.0 if scaling == "linear" else pytest.approx(1 + 0.1 * math.log(4)))
    pos = torch.tensor([0, 1, 17, 4095, 131071])
    cos, sin = nr.rope_tables(pos, rope.inv_freq, rope.magnitude)
    rot = rope.tables(pos)[:, 0]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (5, 32)
    assert torch.equal(cos, rot.real) and torch.equal(sin, rot.imag)


@pytest.mark.parametrize("kind", nr.KINDS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("e,rope_dim", [(64, 64), (64, 32), (128, 128)])
def test_qk_norm_rope_torch_is_the_models(kind, norm, e, rope_dim):
    from appliance.engine.runners.torch.model import Rope, rms_norm
    h, g, eps = 6, 2, 1e-6
    qk, _, _, qn, kn = qk_case(5, h, g, e, rope_dim, norm)
    rope = Rope(rope_args(kind, rope_dim, base=1e6), None, "cpu")
    pos = torch.tensor([0, 3, 100, 2047, 40000])
    want = qk                                           # Attention.__call__, step by step
    if norm:
        want = torch.cat((rms_norm(qk[:, :h], qn, eps), rms_norm(qk[:, h:], kn, eps)), 1)
    want = rope(want, rope.tables(pos))
    got = nr.qk_norm_rope_torch(qk, h, *nr.rope_tables(pos, rope.inv_freq), kind, rope_dim, qn, kn, eps)
    assert_near(got, want)
    assert torch.equal(got[..., rope_dim:], want[..., rope_dim:])   # the tail passes unchanged


# ---------------------------------------------------------------- kernels vs the references

@pytest.mark.parametrize("n,c", [(1, 576), (4, 100), (3, 64), (2, 4096), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_kernel(dev, n, c, dtype):
    x, w = torch.randn(n, c).to(dtype), torch.randn(c)
    x, w = x.to(dev), w.to(dev)
    assert_near(nr.rms_norm(x, w, 1e-5), nr.rms_norm_torch(x, w, 1e-5))


def test_rms_norm_kernel_strided_rows(dev):
    big = torch.randn(9, 700, device=dev)
    w = torch.randn(576, device=dev)
    for x in (big[:, 50:626], big[::2, :576]):        # row stride 700 and 1400, C = 576
        assert not x.is_contiguous()
        assert_near(nr.rms_norm(x, w, 1e-6, nr.NormConfig(num_warps=2)), nr.rms_norm_torch(x, w, 1e-6))
    assert nr.rms_norm(big[:0, :576], w, 1e-6).shape == (0, 576)


@pytest.mark.parametrize("kind", nr.KINDS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n,h,g,e,rope_dim", [
    (1, 6, 2, 32, 32), (3, 6, 2, 64, 64), (3, 6, 2, 64, 32),   # GQA; full and partial rotary
    (2, 4, 4, 64, 16), (2, 6, 2, 80, 40), (2, 3, 1, 96, 64)])  # E, rope_dim/2 not powers of two
def test_qk_norm_rope_kernel(dev, kind, norm, n, h, g, e, rope_dim):
    qk, cos, sin, qn, kn = qk_case(n, h, g, e, rope_dim, norm, dev)
    want = nr.qk_norm_rope_torch(qk, h, cos, sin, kind, rope_dim, qn, kn)
    for bh in (1, 4, 16):                                     # heads per program, masked past H + G
        got = nr.qk_norm_rope(qk, h, cos, sin, kind, rope_dim, qn, kn, config=nr.RopeConfig(block_heads=bh))
        assert_near(got, want)


@pytest.mark.parametrize("kind", nr.KINDS)
def test_qk_norm_rope_kernel_yarn(dev, kind):
    """The model's YaRN rotation (angles blended by pair, cos and sin x 1 + 0.1 ln 8) at positions
    past the original context: the kernel rotates by the tables it is given, as the reference."""
    from appliance.engine.runners.torch.model import Rope
    rope = Rope(rope_args(kind, 64, base=1e5, scale=0.125, scaling="yarn"), None, "cpu")
    qk, _, _, qn, kn = qk_case(3, 6, 2, 64, 64, True, dev)
    pos = torch.tensor([5, 4096 * 3, 4096 * 8 - 1])
    cos, sin = (t.to(dev) for t in nr.rope_tables(pos, rope.inv_freq, rope.magnitude))
    assert cos.abs().max() > 1.2                      # the magnitude is in the tables
    assert_near(nr.qk_norm_rope(qk, 6, cos, sin, kind, 64, qn, kn), nr.qk_norm_rope_torch(qk, 6, cos, sin, kind, 64, qn, kn))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qk_norm_rope_kernel_half_input(dev, dtype):
    qk, cos, sin, qn, kn = qk_case(2, 6, 2, 64, 64, True, dev)
    qk = qk.to(dtype)
    assert_near(nr.qk_norm_rope(qk, 6, cos, sin, "neox", 64, qn, kn),
                nr.qk_norm_rope_torch(qk, 6, cos, sin, "neox", 64, qn, kn))


def test_qk_norm_rope_kernel_in_place(dev):
    qk, cos, sin, qn, kn = qk_case(3, 6, 2, 64, 32, True, dev)
    want = nr.qk_norm_rope_torch(qk, 6, cos, sin, "norm", 32, qn, kn)
    got = nr.qk_norm_rope(qk, 6, cos, sin, "norm", 32, qn, kn, out=qk)   # the strided view itself
    assert got is qk
    assert_near(qk, want)


# ------------------------------------------------------------------------------ bad input

def test_rms_norm_refuses():
    x, w = torch.randn(4, 64), torch.randn(64)
    for args in [(x[0], w), (x.double(), w), (x.int(), w), (x, w[:63]), (x, w.half()),
                 (torch.randn(64, 4).t(), w), (torch.randn(1, nr.MAX_C + 1), torch.randn(nr.MAX_C + 1))]:
        with pytest.raises(ValueError):
            nr.rms_norm(*args, 1e-5)


def qk_bad_cases():
    qk, cos, sin, qn, kn = qk_case(2, 6, 2, 64, 32, True)
    ok = dict(qk=qk, n_q_heads=6, cos=cos, sin=sin, kind="neox", rope_dim=32, q_norm=qn, k_norm=kn)
    c16, s16 = nr.rope_tables(torch.arange(2), inv_freq(16))
    return [dict(ok, kind="gptj"), dict(ok, kind="NEOX"), dict(ok, rope_dim=31), dict(ok, rope_dim=0),
            dict(ok, rope_dim=66), dict(ok, rope_dim=16), dict(ok, cos=c16, sin=s16),
            dict(ok, qk=qk[0]), dict(ok, qk=qk.double()), dict(ok, qk=qk.transpose(1, 2)),
            dict(ok, cos=cos.double()), dict(ok, sin=sin[:1]), dict(ok, cos=cos.t().contiguous().t()),
            dict(ok, k_norm=None), dict(ok, q_norm=qn[:32]), dict(ok, k_norm=kn.half()),
            dict(ok, n_q_heads=0), dict(ok, n_q_heads=8)]


@pytest.mark.parametrize("case", range(len(qk_bad_cases())))
def test_qk_norm_rope_refuses(case):
    kwargs = qk_bad_cases()[case]
    for fn in (nr.qk_norm_rope_torch, nr.qk_norm_rope):     # checked before any launch
        with pytest.raises(ValueError):
            fn(**kwargs)


def test_qk_norm_rope_refuses_config_and_out():
    qk, cos, sin, _, _ = qk_case(2, 6, 2, 64, 64, False)
    with pytest.raises(ValueError, match="power of two"):
        nr.qk_norm_rope(qk, 6, cos, sin, "norm", 64, config=nr.RopeConfig(block_heads=3))
    for out in (torch.empty(2, 8, 63), torch.empty(2, 8, 64, dtype=torch.float16)):
        with pytest.raises(ValueError, match="out"):
            nr.qk_norm_rope(qk, 6, cos, sin, "norm", 64, out=out)


def test_no_kernel_is_a_runtime_error(monkeypatch):
    monkeypatch.setattr(nr, "available", lambda device: False)   # as without Triton
    qk, cos, sin, _, _ = qk_case(2, 6, 2, 64, 64, False)
    with pytest.raises(RuntimeError, match="_torch reference"):
        nr.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="_torch reference"):
        nr.qk_norm_rope(qk, 6, cos, sin, "norm", 64)


# ------------------------------------------------------------------- GPU, realistic shapes

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_gpu():
    pytest.importorskip("triton")
    x = torch.randn(512, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda")
    assert_near(nr.rms_norm(x, w, 1e-5), nr.rms_norm_torch(x, w, 1e-5), rel=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,rope_dim,norm", [("neox", 128, True), ("norm", 128, False), ("neox", 64, True)])
def test_qk_norm_rope_gpu(kind, rope_dim, norm):
    pytest.importorskip("triton")
    qk, cos, sin, qn, kn = qk_case(512, 32, 8, 128, rope_dim, norm, "cuda")
    want = nr.qk_norm_rope_torch(qk, 32, cos, sin, kind, rope_dim, qn, kn)
    assert_near(nr.qk_norm_rope(qk, 32, cos, sin, kind, rope_dim, qn, kn), want, rel=2e-6)
    assert_near(nr.qk_norm_rope(qk.to(torch.bfloat16), 32, cos, sin, kind, rope_dim, qn, kn),
                nr.qk_norm_rope_torch(qk.to(torch.bfloat16), 32, cos, sin, kind, rope_dim, qn, kn), rel=2e-6)
