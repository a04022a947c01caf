"""Decode attention: the Triton kernels against the torch reference, and the property the runner
relies on (a row's bits do not depend on the rows launched with it).

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1): shapes are tiny and blocks small enough to cross several key blocks and
splits. The interpreter mishandles bfloat16, so bfloat16 pools are only tested on a GPU.
Tolerance: 1e-5 (absolute and relative) against the float32 reference; both upcast the same
pool values exactly and differ only in summation order and exp2 vs exp.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels import INTERPRET, available
from kernels import decode_attention as da
from kernels.decode_attention import DecodeAttentionConfig, decode_attention, decode_attention_torch

DEVICE = "cpu" if INTERPRET else "cuda"
needs_kernel = pytest.mark.skipif(not available(DEVICE), reason=f"Triton cannot launch on {DEVICE}")
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = DecodeAttentionConfig(block_n=16, split_keys=32)   # 100 keys: 7 blocks, 4 splits
TOL = dict(atol=1e-5, rtol=1e-5)


def make_pool(n_layer=2, n_slots=3, g=2, n_ctx=100, e=16, dtype=torch.float32, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_layer, n_slots, g, n_ctx, e, generator=gen).to(dtype).to(device) for _ in "kv")
    return k, v


def make_rows(slots, positions, h, e, device=DEVICE, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(slots), h, e, generator=gen).to(device)
    return q, torch.tensor(slots, device=device), torch.tensor(positions, device=device)


# -- the reference (runs without Triton) ------------------------------------------------------

def test_reference_matches_sdpa():
    k, v = make_pool(g=2, e=16, device="cpu")
    q, slots, pos = make_rows([0, 2, 1], [0, 40, 99], h=4, e=16, device="cpu")
    out = decode_attention_torch(q, k, v, 1, slots, pos, 0.25)
    for r in range(3):
        s, p = int(slots[r]), int(pos[r])
        want = F.scaled_dot_product_attention(q[r][:, None], k[1, s, :, :p + 1], v[1, s, :, :p + 1],
                                              scale=0.25, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[r], want, **TOL)


@pytest.mark.parametrize("change, match", [
    (dict(q=lambda q: q.half()), "float32"),
    (dict(k=lambda k: k.to(torch.int8), v=lambda v: v.to(torch.int8)), "dtype"),
    (dict(v=lambda v: v.half()), "dtype"),
    (dict(q=lambda q: q[:, :3]), "multiple of G"),
    (dict(q=lambda q: q[..., :8]), "E must match"),
    (dict(pos=lambda p: p + 60), "positions"),
    (dict(pos=lambda p: p - 1), "positions"),
    (dict(slots=lambda s: s + 2), "slots"),
    (dict(pos=lambda p: p.int()), "int64"),
    (dict(layer=lambda n: 2), "layer"),
])
def test_wrapper_refuses_bad_input(change, match):
    k, v = make_pool(device="cpu")
    q, slots, pos = make_rows([0, 1], [0, 50], h=4, e=16, device="cpu")
    args = dict(q=q, k=k, v=v, layer=1, slots=slots, pos=pos)
    args.update({name: fn(args[name]) for name, fn in change.items()})
    with pytest.raises(ValueError, match=match):
        decode_attention(args["q"], args["k"], args["v"], args["layer"], args["slots"], args["pos"], 0.25, SMALL)


@pytest.mark.parametrize("kw", [dict(block_n=24), dict(block_n=8), dict(block_n=32, split_keys=48)])
def test_config_refuses_bad_blocks(kw):
    with pytest.raises(ValueError):
        DecodeAttentionConfig(**kw)


def test_refuses_to_launch_where_triton_cannot(monkeypatch):
    monkeypatch.setattr(da, "available", lambda device: False)
    k, v = make_pool(device="cpu")
    q, slots, pos = make_rows([0], [5], h=4, e=16, device="cpu")
    with pytest.raises(RuntimeError, match="decode_attention_torch"):
        decode_attention(q, k, v, 0, slots, pos, 0.25, SMALL)


# -- the kernels (interpreted here, compiled on a GPU) ----------------------------------------

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h, g, e", [(4, 2, 16), (6, 3, 32), (8, 1, 24)])   # 24: E padded to 32
def test_kernel_matches_reference(h, g, e, dtype):
    k, v = make_pool(g=g, e=e, dtype=dtype)
    # 0; the last key of a block and of a split; mid-block; across several splits; the last key
    slots, positions = [0, 2, 1, 0, 2, 1], [0, 15, 31, 37, 70, 99]
    q, slots, pos = make_rows(slots, positions, h=h, e=e)
    scale = e ** -0.5
    out = decode_attention(q, k, v, 1, slots, pos, scale, SMALL)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, 1, slots, pos, scale), **TOL)


@needs_kernel
def test_keys_past_the_position_are_never_read():
    k, v = make_pool()
    q, slots, pos = make_rows([0, 1], [20, 45], h=4, e=16)
    want = decode_attention(q, k, v, 0, slots, pos, 0.25, SMALL)
    k[0, 0, :, 21:], v[0, 0, :, 21:] = float("nan"), float("nan")   # stale entries of the pool
    k[0, 1, :, 46:], v[0, 1, :, 46:] = float("nan"), float("nan")
    assert torch.equal(decode_attention(q, k, v, 0, slots, pos, 0.25, SMALL), want)


@needs_kernel
def test_strided_views_need_no_copy():
    big_k, big_v = make_pool(n_ctx=120, e=32)
    k, v = big_k[..., :100, :16], big_v[..., 4:104, 16:]          # neither is contiguous
    q_big, slots, pos = make_rows([2, 0], [3, 88], h=8, e=16)
    q = q_big.transpose(1, 2).contiguous().transpose(1, 2)        # [R, H, E] with H innermost
    assert not (k.is_contiguous() or v.is_contiguous() or q.is_contiguous())
    out = decode_attention(q, k, v, 1, slots, pos, 0.25, SMALL)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, 1, slots, pos, 0.25), **TOL)


@needs_kernel
def test_default_config():
    k, v = make_pool(n_slots=2, n_ctx=300)                       # default blocks: 2 splits
    q, slots, pos = make_rows([1, 0], [63, 299], h=4, e=16)
    out = decode_attention(q, k, v, 0, slots, pos, 0.25)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, 0, slots, pos, 0.25), **TOL)


@needs_kernel
def test_no_rows():
    k, v = make_pool()
    q, slots, pos = make_rows([], [], h=4, e=16)
    assert decode_attention(q.view(0, 4, 16), k, v, 0, slots.long(), pos.long(), 0.25).shape == (0, 4, 16)


def check_rows_alone_equal_together(q, k, v, slots, pos, scale, config):
    together = decode_attention(q, k, v, 1, slots, pos, scale, config)
    for r in range(q.shape[0]):
        alone = decode_attention(q[r:r + 1].clone(), k, v, 1, slots[r:r + 1], pos[r:r + 1], scale, config)
        assert torch.equal(alone[0], together[r]), f"row {r} differs launched alone"
    flip = torch.arange(q.shape[0] - 1, -1, -1, device=q.device)  # other neighbours, other order
    assert torch.equal(decode_attention(q[flip], k, v, 1, slots[flip], pos[flip], scale, config)[flip], together)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_alone_equal_rows_together(dtype):
    k, v = make_pool(dtype=dtype)
    # a short row beside long ones: the grid spans 4 splits, the short row uses 1
    q, slots, pos = make_rows([0, 0, 1, 2, 0], [5, 99, 64, 31, 6], h=4, e=16)
    check_rows_alone_equal_together(q, k, v, slots, pos, 0.25, SMALL)


@needs_kernel
def test_a_grid_sized_from_max_position_gives_the_same_bits():
    """max_position (a CUDA graph's bound, nothing read back): more splits, each row's bits the
    same as with the grid sized from the call's positions."""
    k, v = make_pool()
    q, slots, pos = make_rows([0, 1, 2], [5, 40, 31], h=4, e=16)
    want = decode_attention(q, k, v, 1, slots, pos, 0.25, SMALL)
    assert torch.equal(decode_attention(q, k, v, 1, slots, pos, 0.25, SMALL, max_position=99), want)
    with pytest.raises(ValueError, match="max_position"):
        decode_attention(q, k, v, 1, slots, pos, 0.25, SMALL, max_position=100)


# -- on a GPU, realistic shapes ---------------------------------------------------------------

def gpu_case(dtype):
    """8 query heads a KV head, rows at the split edges (256) and near 4,096 keys."""
    k, v = make_pool(n_layer=2, n_slots=4, g=8, n_ctx=4096, e=128, dtype=dtype, device="cuda")
    q, slots, pos = make_rows([0, 3, 1, 2, 0, 3], [0, 255, 256, 1000, 4000, 4095], h=32, e=128,
                              device="cuda")
    return q, k, v, slots, pos, 128 ** -0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@no_cuda
def test_gpu_realistic_shape_matches_reference(dtype):
    q, k, v, slots, pos, scale = gpu_case(dtype)
    out = decode_attention(q, k, v, 1, slots, pos, scale)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, 1, slots, pos, scale), atol=5e-5, rtol=5e-5)


@pytest.mark.gpu
@no_cuda
def test_gpu_rows_alone_equal_rows_together():
    q, k, v, slots, pos, scale = gpu_case(torch.bfloat16)
    check_rows_alone_equal_together(q, k, v, slots, pos, scale, DecodeAttentionConfig())
