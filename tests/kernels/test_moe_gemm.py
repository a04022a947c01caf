"""The grouped expert GEMM against its reference (each tile's rows @ its expert's dequantized
matrix) and against a plain loop over experts, under Triton's interpreter on CPU and on a GPU
when there is one: every block format and dense weights, ragged expert counts (an expert with
one pair, one with none, one over several tiles), K not a multiple of BLOCK_K, a pool of slots
indexed out of expert order; a pair's result independent of the other pairs."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import gguf  # noqa: E402
from gguf import quants  # noqa: E402

from kernels import INTERPRET  # noqa: E402
from kernels.formats import FORMATS, dequantize_torch, quantize_nvfp4_torch  # noqa: E402
from kernels.moe_gemm import moe_gemm, moe_gemm_torch, route  # noqa: E402
from kernels.bench_cases import random_blocks  # noqa: E402
from kernels.wgemm import GemmConfig  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="no GPU and not under TRITON_INTERPRET=1")
CFG = GemmConfig(block_m=16, block_n=32, block_k=64)


def stacked(name: str | None, x: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """X experts' [N, K] matrices: GGUF blocks uint8 [X, N, row bytes], or dense float32."""
    w = np.random.default_rng(seed).standard_normal((x, n, k)).astype(np.float32)
    if name is None:
        return torch.from_numpy(w)
    if name == "nvfp4":
        return torch.stack([quantize_nvfp4_torch(torch.from_numpy(m)) for m in w])
    qt = gguf.GGMLQuantizationType[name.upper()]
    if FORMATS[name].block == 256:   # the K-quants, which gguf cannot quantize: random codes and scales
        return torch.stack([random_blocks(name, n, k, torch.Generator().manual_seed(seed + e), "cpu") for e in range(x)])
    return torch.stack([torch.from_numpy(quants.quantize(m, qt)) for m in w])


def routed(n_rows: int, n_expert: int, top_k: int, seed: int = 1):
    """A router's choice for n_rows rows, grouped as the runner groups it: (rows sorted by
    expert, counts per expert, the (row, expert) pairs in that order)."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(n_expert, generator=g)[:top_k] for _ in range(n_rows)])
    chosen[0, 0] = n_expert - 1            # expert X-1 has at least one pair ...
    chosen[chosen == 2] = 1                # ... and expert 2 none
    order = torch.argsort(chosen.flatten(), stable=True)
    rows = (order // top_k).numpy()
    experts = chosen.flatten()[order].numpy()
    return rows, np.bincount(experts, minlength=n_expert), experts


def loop_reference(x, w, fmt, k, rows, experts):
    """A plain loop: each pair's row @ its expert's matrix^T, float32."""
    mats = [w[e].float() if fmt is None else dequantize_torch(w[e], fmt, k) for e in range(w.shape[0])]
    return torch.stack([x[r].float() @ mats[e].T for r, e in zip(rows, experts)])


@pytest.mark.parametrize("name", [None, *FORMATS])
@pytest.mark.parametrize("n_rows,top_k", [(1, 2), (7, 2), (40, 3)])
def test_grouped_equals_the_reference_and_a_loop(name, n_rows, top_k):
    n_expert, n, k = 6, 40, 192
    k = k if name is None or k % FORMATS[name].block == 0 else (128 if FORMATS[name].block < 256 else 256)
    w = stacked(name, n_expert, n, k)
    x = torch.randn(n_rows, k)
    rows, counts, experts = routed(n_rows, n_expert, top_k)
    r = route(rows, counts, np.arange(n_expert), CFG.block_m, DEVICE)
    assert r.padded % CFG.block_m == 0 and len(r.pairs) == len(rows)
    y = moe_gemm(x.to(DEVICE), w.to(DEVICE), r, name, k, CFG).cpu()
    ref = moe_gemm_torch(x, w, route(rows, counts, np.arange(n_expert), CFG.block_m, "cpu"), name, k)
    scale = float(ref.abs().max())
    assert float((y - ref).abs().max()) / scale < 1e-5
    got = y[r.pairs.cpu()]
    assert float((got - loop_reference(x, w, name, k, rows, experts)).abs().max()) / scale < 1e-5
    pad = torch.ones(r.padded, dtype=torch.bool)
    pad[r.pairs.cpu()] = False
    assert torch.all(y[pad] == 0)          # padding rows read zeros


def test_slots_out_of_expert_order_and_half_precision_weights():
    """The expert cache's pool: expert e's matrix in slot index[e], weights in float16."""
    n_expert, n, k = 5, 24, 96
    w = stacked(None, n_expert, n, k).half()
    slot_of = np.array([3, 0, 4, 1, 2])
    pool = torch.empty_like(w)
    pool[slot_of] = w
    x = torch.randn(9, k)
    rows, counts, experts = routed(9, n_expert, 2, seed=4)
    y = moe_gemm(x.to(DEVICE), pool.to(DEVICE), route(rows, counts, slot_of, 16, DEVICE), None, k, CFG).cpu()
    r = route(rows, counts, slot_of, 16, "cpu")
    ref = loop_reference(x, w, None, k, rows, experts)
    assert float((y[r.pairs] - ref).abs().max() / ref.abs().max()) < 1e-5


def test_the_second_matmul_reads_rows_in_padded_order():
    """gate/up then down: the second call's rows are the first call's output, already in the
    padded order (Routing.identity), and padding stays zero."""
    n_expert, d, f = 4, 64, 96
    gate_up, down = stacked("q8_0", n_expert, 2 * f, d), stacked("q8_0", n_expert, d, f, seed=2)
    x = torch.randn(5, d)
    rows, counts, experts = routed(5, n_expert, 2)
    r = route(rows, counts, np.arange(n_expert), 16, DEVICE)
    h = moe_gemm(x.to(DEVICE), gate_up.to(DEVICE), r, "q8_0", d, CFG)
    a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
    y = moe_gemm(a, down.to(DEVICE), r.identity(), "q8_0", f, CFG).cpu()
    gu = loop_reference(x, gate_up, "q8_0", d, rows, experts)
    want = loop_reference(torch.nn.functional.silu(gu[:, :f]) * gu[:, f:], down, "q8_0", f,
                          range(len(rows)), experts)
    assert float((y[r.pairs.cpu()] - want).abs().max() / want.abs().max()) < 1e-5


def test_a_pair_does_not_depend_on_the_others():
    """One row routed alone and the same row among 30 others: its expert outputs are the same
    bits wherever its pair sits in a tile (the runner's exactness property)."""
    n_expert, n, k = 4, 48, 128
    w = stacked("q4_0", n_expert, n, k).to(DEVICE)
    x = torch.randn(31, k)
    rows, counts, experts = routed(31, n_expert, 2, seed=7)
    r = route(rows, counts, np.arange(n_expert), 16, DEVICE)
    full = moe_gemm(x.to(DEVICE), w, r, "q4_0", k, CFG).cpu()[r.pairs.cpu()]
    for i in (0, 5, 30):
        mine = np.flatnonzero(rows == i)
        one_rows, one_exp = np.zeros(len(mine), dtype=np.int64), experts[mine]
        one = route(one_rows, np.bincount(one_exp, minlength=n_expert), np.arange(n_expert), 16, DEVICE)
        y = moe_gemm(x[i:i + 1].to(DEVICE), w, one, "q4_0", k, CFG).cpu()[one.pairs.cpu()]
        assert torch.equal(y, full[mine]), i


def test_bad_input_is_refused():
    w = stacked("q4_1", 2, 8, 64)
    x = torch.randn(2, 64)
    r = route(np.array([0, 1]), np.array([1, 1]), np.arange(2), 16, "cpu")
    with pytest.raises(ValueError, match="x must be"):
        moe_gemm(x[:, :32], w, r, "q4_1", 64, CFG)
    with pytest.raises(ValueError, match="W must be"):
        moe_gemm(x, w[:, :, :10], r, "q4_1", 64, CFG)
    with pytest.raises(ValueError, match="block_m"):
        moe_gemm(x, w, r, "q4_1", 64, GemmConfig(block_m=32))
    with pytest.raises(ValueError, match="split"):
        moe_gemm(x, w, r, "q4_1", 64, GemmConfig(block_m=16, split_k=2))
    with pytest.raises(ValueError, match="W must be dense"):
        moe_gemm(x, w, r, None, 64, CFG)


def test_no_pairs_is_an_empty_result():
    w = stacked(None, 3, 8, 32)
    r = route(np.zeros(0, dtype=np.int64), np.zeros(3, dtype=np.int64), np.arange(3), 16, DEVICE)
    y = moe_gemm(torch.randn(0, 32).to(DEVICE), w.to(DEVICE), r, None, 32, CFG)
    assert y.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", [None, "q4_0", "nvfp4"])
def test_gpu_bf16_moe_shape(name):
    """A Qwen3-30B-A3B-sized expert layer (128 experts, k 8, D 2048, F 768) in bfloat16 on the
    tensor cores: within the bf16 rounding of x and W, 2e-2 of the largest output."""
    n_expert, n, k, m = 128, 2 * 768, 2048, 64
    w = stacked(name, n_expert, n, k)
    w = w.bfloat16() if name is None else w
    x = torch.randn(m, k)
    rows, counts, _ = routed(m, n_expert, 8)
    r = route(rows, counts, np.arange(n_expert), 16, "cuda")
    y = moe_gemm(x.cuda().bfloat16(), w.cuda(), r, name, k, GemmConfig(block_m=16, dot="bf16")).cpu()
    ref = moe_gemm_torch(x, w, route(rows, counts, np.arange(n_expert), 16, "cpu"), name, k)
    assert float((y - ref).abs().max() / ref.abs().max()) < 2e-2
