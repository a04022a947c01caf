"""The torch decoders of `kernels.formats` against `gguf.quants.dequantize`, bit for bit, on
blocks `gguf` quantized and on random bytes (every scale and code value a file can hold), and
the NVFP4 quantizer's output read back by gguf."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gguf  # noqa: E402
from gguf import quants  # noqa: E402

from kernels.formats import (FORMATS, dequantize_torch, format_of, nvfp4_modelopt_torch,  # noqa: E402
                             quantize_nvfp4_torch, row_bytes)

T = gguf.GGMLQuantizationType
GGUF_QUANTIZES = ("q4_0", "q4_1", "q8_0", "mxfp4")


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (16, 256)])
def test_decoder_equals_gguf_on_quantized_blocks(name, n, k):
    w = np.random.default_rng(n * k).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, T[name.upper()])
    got = dequantize_torch(torch.from_numpy(raw), name, k).numpy()
    assert np.array_equal(bits(got), bits(quants.dequantize(raw, T[name.upper()])))


F16_AT = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}   # each block's f16 scales


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "q8_0", "q4_k", "q5_k", "q6_k"])
def test_decoder_equals_gguf_on_random_bytes(name):
    """Random bytes reach scale values a quantizer rarely writes (E8M0 extremes, UE4M3 with bit
    7 set, subnormals, 0x7F, every six-bit K-quant scale and min, every bit of the K-quants'
    high planes); f16 scales kept finite (gguf cannot quantize the K-quants: this is their test)."""
    fmt = FORMATS[name]
    k = fmt.block * 5
    raw = np.random.default_rng(1).integers(0, 256, (9, row_bytes(fmt, k)), dtype=np.uint8)
    for at in F16_AT.get(name, ()):   # keep every f16 scale finite (exponent bits not all ones)
        raw.reshape(9, 5, fmt.nbytes)[..., at + 1] &= 0x7B
    got = dequantize_torch(torch.from_numpy(raw), name, k).numpy()
    ref = quants.dequantize(raw, T[name.upper()])
    assert np.array_equal(bits(got), bits(ref))


def test_format_lookup_and_refusals():
    assert format_of(T.NVFP4) is FORMATS["nvfp4"] and format_of("Q4_1") is FORMATS["q4_1"]
    with pytest.raises(ValueError, match="no kernel format"):
        format_of("q2_k")
    with pytest.raises(ValueError, match="multiple"):
        row_bytes(FORMATS["nvfp4"], 96)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_torch(torch.zeros(2, 17), "mxfp4", 32)


def test_nvfp4_quantizer_round_trips_through_gguf():
    w = torch.randn(12, 192) * 0.05
    raw = quantize_nvfp4_torch(w)
    assert raw.shape == (12, 3 * 36) and raw.dtype == torch.uint8
    back = quants.dequantize(raw.numpy(), T.NVFP4)
    assert np.array_equal(back, dequantize_torch(raw, "nvfp4", 192).numpy())
    rel = float(np.sqrt(((back - w.numpy()) ** 2).mean()) / w.std())
    # 4-bit with an FP8 scale per 16 values: measured 0.085 here; Q4_0's blocks of 32, 0.091
    assert rel < 0.1, rel
    # the values that are exactly representable come back exactly
    exact = torch.tensor([[0.5, -1.0, 1.5, 2.0, 3.0, -4.0, 6.0, 0.0] * 8])
    assert torch.equal(dequantize_torch(quantize_nvfp4_torch(exact), "nvfp4", 64), exact)


def test_nvfp4_quantizer_picks_the_better_neighbouring_scale():
    """Each sub-block's scale is one of the two UE4M3 values around amax / 6, the one with the
    smaller error: never worse than rounding the scale to nearest alone."""
    w = torch.randn(64, 256)
    ours = dequantize_torch(quantize_nvfp4_torch(w), "nvfp4", 256)
    err = ((ours - w) ** 2).reshape(64, 16, 16).sum(-1)
    # the same sub-blocks with the scale from gguf's own fp32 -> ue4m3 rounding
    amax = w.abs().reshape(64, 16, 16).amax(-1) / 6
    s = torch.from_numpy(quants.NVFP4.ue4m3_to_fp32(quants.NVFP4.fp32_to_ue4m3(amax.numpy() * 2)))
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x = w.reshape(64, 16, 16) / s[..., None]
    q = grid[(x.abs()[..., None] - grid).abs().argmin(-1)] * x.sign() * s[..., None]
    assert bool((err <= ((q - w.reshape(64, 16, 16)) ** 2).sum(-1) + 1e-6).all())


def test_modelopt_layout():
    """ModelOpt: element 2j in the low nibble of byte j, an E4M3 scale per 16, a tensor scale."""
    codes = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25], [4.0, 1.0]]).to(torch.float8_e4m3fn)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    want = e2m1[codes.long()] * scale.float().repeat_interleave(16, 1) * 0.125
    assert torch.equal(nvfp4_modelopt_torch(packed, scale, torch.tensor([0.125])), want)
