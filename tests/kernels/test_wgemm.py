"""The weight-only GEMM against its reference (x @ dequantize(W)^T), under Triton's interpreter
on CPU (tiny ragged shapes, IEEE float32 dots) and on a GPU when there is one: every format,
batch 1 and several rows, N and M not multiples of the tiles, K not a multiple of BLOCK_K,
split-K; and the in-register decode equal to gguf's bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import gguf  # noqa: E402
from gguf import quants  # noqa: E402

from kernels import INTERPRET  # noqa: E402
from kernels.formats import FORMATS, quantize_nvfp4_torch  # noqa: E402
from kernels.bench_cases import random_blocks  # noqa: E402
from kernels.wgemm import GemmConfig, wgemm, wgemm_torch  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="no GPU and not under TRITON_INTERPRET=1")
pytestmark = needs_device
gpu = pytest.mark.gpu


K_QUANTS = ("q4_k", "q5_k", "q6_k")   # gguf cannot quantize them: random codes and scales


def blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))
    if name == "nvfp4":
        return w, quantize_nvfp4_torch(w)
    if name in K_QUANTS:
        return w, random_blocks(name, n, k, torch.Generator().manual_seed(seed), "cpu")
    return w, torch.from_numpy(quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name.upper()]))


SHAPES = [(1, 40, 192), (5, 70, 128), (33, 64, 320)]   # (M, N, K)
CONFIGS = [GemmConfig(block_m=16, block_n=32, block_k=64),
           GemmConfig(block_m=32, block_n=64, block_k=128, split_k=2)]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_equals_reference(name, m, n, k):
    block = FORMATS[name].block
    if k % block:
        k = max(block, k // 64 * 64 // block * block)
    _, raw = blocks(name, n, k)
    x = torch.randn(m, k)
    ref = wgemm_torch(x, raw, name, k)
    for cfg in CONFIGS:
        y = wgemm(x.to(DEVICE), raw.to(DEVICE), name, k, cfg).cpu()
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (cfg, err)     # IEEE float32 dots: measured up to 4.5e-7


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_in_registers_is_gguf_bit_for_bit(name):
    """x = I gives y = W^T exactly (one nonzero term per sum): the kernel's decode of every
    block, scales included, equals gguf's dequantization (a sum of zeros is +0 where gguf's
    d * 0 can be -0: equal as numbers, every nonzero value equal to the bit)."""
    k = max(128, FORMATS[name].block)
    _, raw = blocks(name, 24, k, seed=3)
    cfg = GemmConfig(block_m=64, block_n=32, block_k=64, dot="fp32")   # IEEE float32 dots (a K-quant's 256 in 4 slices)
    y = wgemm(torch.eye(k).to(DEVICE), raw.to(DEVICE), name, k, cfg).cpu()
    ref = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name.upper()])
    got = y.T.numpy()
    assert np.array_equal(got, ref)
    nz = ref != 0
    assert np.array_equal(got[nz].view(np.uint32), ref[nz].view(np.uint32))


@pytest.mark.parametrize("k,cfg", [(256, None), (64, GemmConfig(block_m=64, block_n=256, block_k=128)),
                                   (192, GemmConfig(block_m=32, block_n=64, block_k=64, split_k=2))])
def test_a_row_does_not_depend_on_the_others(k, cfg):
    """A row alone and in a batch of 37, wherever it sits in its tile: the same bits (the
    runner's exactness property). The second case is the runner's default under the
    interpreter on a tiny model's width, where numpy's matmul (the interpreter's tl.dot) gave
    a row that sits lower in the tile other bits on a Zen 5 host."""
    _, raw = blocks("q4_0", 50, k)
    x = torch.randn(37, k)
    full = wgemm(x.to(DEVICE), raw.to(DEVICE), "q4_0", k, cfg).cpu()
    for i in (0, 1, 6, 17, 31, 36):
        one = wgemm(x[i:i + 1].to(DEVICE), raw.to(DEVICE), "q4_0", k, cfg).cpu()
        assert torch.equal(one[0], full[i]), i


def test_half_precision_activations_and_strided_rows():
    _, raw = blocks("q8_0", 32, 128)
    x = torch.randn(64, 256)[::2, :128]               # rows strided, not contiguous
    y = wgemm(x.to(DEVICE).half(), raw.to(DEVICE), "q8_0", 128).cpu()
    ref = wgemm_torch(x.half(), raw, "q8_0", 128)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


def test_bad_input_is_refused():
    _, raw = blocks("q4_1", 8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must be"):
        wgemm(x[:, :32], raw, "q4_1", 64)
    with pytest.raises(ValueError, match="W must be"):
        wgemm(x, raw[:, :10], "q4_1", 64)
    with pytest.raises(ValueError, match="block_k"):
        wgemm(x, raw, "nvfp4", 64, GemmConfig(block_k=32))
    with pytest.raises(ValueError, match="power of two"):
        wgemm(x, raw, "q4_1", 64, GemmConfig(block_n=48))
    with pytest.raises(ValueError, match="no kernel format"):
        wgemm(x, raw, "q2_k", 64)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("m", [1, 16, 512])
def test_gpu_bf16_llama_shape(name, m):
    """bfloat16 operands on the tensor cores: relative error of the bf16 rounding of x and the
    decoded W (about 2^-8 each), bounded at 2e-2 of the largest output."""
    n, k = 4096, 4096
    _, raw = blocks(name, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = wgemm_torch(x.float().cpu(), raw, name, k)
    y = wgemm(x, raw.cuda(), name, k, GemmConfig(dot="bf16")).cpu()
    assert float((y - ref).abs().max() / ref.abs().max()) < 2e-2
