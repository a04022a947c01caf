"""Weight formats as the files store them, decoded in plain torch: the references every kernel
in this package is checked against, written from the formats' specs (and checked bit for bit
against `gguf.quants.dequantize` in the tests).

GGUF stores a quantized matrix [N, K] (PyTorch order: N output rows, K inputs) as N rows of
K / B blocks, each block B consecutive inputs of one row, in `nbytes` bytes:

  format   B   bytes  block layout                               value of element i
  q4_0     32  18     f16 d, 16 B of nibbles                     d * (q - 8)
  q4_1     32  20     f16 d, f16 m, 16 B of nibbles              d * q + m
  q8_0     32  34     f16 d, 32 int8                             d * q
  mxfp4    32  17     E8M0 e, 16 B of nibbles                    E2M1(q) * 2^(e - 127)
  nvfp4    64  36     4 x UE4M3 s (one per 16), 32 B of nibbles  E2M1(q) * s[i // 16]
  q4_k     256 144    f16 d, f16 dmin, 12 B of 6-bit scales      d sc[j] q - dmin m[j], j = i // 32
                      and mins, 128 B of nibbles
  q5_k     256 176    q4_k's, then 32 B of fifth bits before     the same, q of 5 bits
                      the nibbles
  q6_k     256 210    128 B of low nibbles, 64 B of bit pairs,   d sc[i // 16] (q - 32), q of 6 bits
                      16 int8 scales, f16 d

Nibbles: in q4_0, q4_1 and mxfp4, byte j holds element j (low nibble) and j + 16 (high). In
nvfp4 each 16-element sub-block s owns bytes 8s .. 8s + 7: byte j holds element j (low) and
j + 8 (high) of that sub-block. In the K-quants (super-blocks of 256) sub-block j of 32
(q4_k, q5_k) takes its nibbles from bytes 32 (j // 2) .. + 31, low for even j, high for odd,
and its fifth bit (q5_k) from bit j of byte i % 32 of the high bits; its six-bit scale and
min are ggml's get_scale_min_k4 (j < 4: scales[j] & 63 and scales[j + 4] & 63; else the low
or high nibble of scales[j + 4] with the top two bits of scales[j - 4] or scales[j]). q6_k
reads element i of half h = i // 128 (r = i % 128, quarter c = r // 32, l = r % 32) from the
low (c < 2) or high nibble of byte 64 h + l + 32 (c % 2) and bits 2c, 2c + 1 of byte
128 + 32 h + l. f16 scales are little-endian. E2M1 codes 0..15 are
{0, 0.5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign; ggml stores them doubled as integers
{0, 1, 2, 3, 4, 6, 8, 12} and halves the block scale instead, which is what these decoders
do too (the products are exact either way). UE4M3 is E4M3 without a sign: exponent bits 6..3
(bias 7), mantissa 2..0, 0x7F (NaN) read as 0; bit 7 is ignored, as ggml ignores it.

NVIDIA ModelOpt's NVFP4 checkpoints use a different layout (`nvfp4_modelopt_torch`): packed
uint8 [N, K / 2] (element 2j low nibble, 2j + 1 high), an E4M3 scale [N, K / 16] and an FP32
tensor scale `weight_scale_2` that multiplies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    block: int        # values per block
    nbytes: int       # bytes per block
    code: int         # the kernels' constexpr for this format


FORMATS = {f.name: f for f in (
    Format("q4_0", 32, 18, 0), Format("q4_1", 32, 20, 1), Format("q8_0", 32, 34, 2),
    Format("mxfp4", 32, 17, 3), Format("nvfp4", 64, 36, 4),
    Format("q4_k", 256, 144, 5), Format("q5_k", 256, 176, 6), Format("q6_k", 256, 210, 7))}

E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def format_of(name) -> Format:
    """A format by name ("q4_0", ...) or by a gguf GGMLQuantizationType."""
    key = getattr(name, "name", name)
    fmt = FORMATS.get(str(key).lower())
    if fmt is None:
        raise ValueError(f"no kernel format for {key!r} (known: {', '.join(FORMATS)})")
    return fmt


def row_bytes(fmt: Format, k: int) -> int:
    if k % fmt.block:
        raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block} values; K = {k} is not a multiple")
    return k // fmt.block * fmt.nbytes


def ue4m3_table() -> torch.Tensor:
    """The 256 byte values of an unsigned E4M3 scale, halved (ggml's doubled-E2M1 convention)."""
    x = torch.arange(256, dtype=torch.int64)
    exp, man = (x >> 3) & 0xF, (x & 7).double()
    value = torch.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * torch.pow(2.0, exp.double() - 7))
    value = torch.where((x == 0) | (x == 0x7F), torch.zeros_like(value), value)
    return (value * 0.5).float()


def e8m0_half_table() -> torch.Tensor:
    """The 256 values of an E8M0 exponent byte, halved: 2^(e - 128), exact in float32."""
    return torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 128).float()


def _f16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 from two uint8 tensors -> float32."""
    return torch.stack((lo, hi), dim=-1).view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).long()


def dequantize_torch(raw: torch.Tensor, fmt, k: int) -> torch.Tensor:
    """raw uint8 [N, row_bytes] in format `fmt` -> float32 [N, K]."""
    fmt = format_of(fmt)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(fmt, k):
        raise ValueError(f"{fmt.name} rows of K = {k} are uint8 [N, {row_bytes(fmt, k)}]; "
                         f"got {raw.dtype} {list(raw.shape)}")
    n = raw.shape[0]
    b = raw.reshape(n, k // fmt.block, fmt.nbytes)
    doubled = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=raw.device)
    if fmt.name == "q4_0":
        d = _f16(b[..., 0], b[..., 1])[..., None]
        w = d * (_nibbles(b[..., 2:]) - 8).float()
    elif fmt.name == "q4_1":
        d, m = _f16(b[..., 0], b[..., 1])[..., None], _f16(b[..., 2], b[..., 3])[..., None]
        w = d * _nibbles(b[..., 4:]).float() + m
    elif fmt.name == "q8_0":
        d = _f16(b[..., 0], b[..., 1])[..., None]
        w = b[..., 2:].view(torch.int8).float() * d
    elif fmt.name == "mxfp4":
        d = e8m0_half_table().to(raw.device)[b[..., 0].long()][..., None]
        w = d * doubled[_nibbles(b[..., 1:])]
    elif fmt.name == "nvfp4":  # four 16-value sub-blocks, each with its own scale and 8 bytes
        s = ue4m3_table().to(raw.device)[b[..., :4].long()][..., None]           # [N, K/64, 4, 1]
        qs = b[..., 4:].reshape(n, k // 64, 4, 8)
        w = s * doubled[_nibbles(qs)]
    elif fmt.name in ("q4_k", "q5_k"):
        d, dmin = _f16(b[..., 0], b[..., 1])[..., None, None], _f16(b[..., 2], b[..., 3])[..., None, None]
        sc, m = _scale_min_k4(b[..., 4:16])                                       # [N, K/256, 8] each
        qs = b[..., -128:].reshape(n, k // 256, 4, 1, 32)
        q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).view(2, 1)) & 15).reshape(n, k // 256, 8, 32)
        if fmt.name == "q5_k":
            qh = b[..., 16:48].reshape(n, k // 256, 1, 32)
            q = q | (((qh >> torch.arange(8, dtype=torch.uint8, device=raw.device).view(8, 1)) & 1) << 4)
        w = (d * sc.float()[..., None]) * q.float() - dmin * m.float()[..., None]
    else:  # q6_k
        ql = b[..., :128].reshape(n, k // 256, 2, 1, 2, 32)                        # [.., half, lo/hi, c % 2, l]
        low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).view(2, 1, 1)) & 15).reshape(n, k // 256, 2, 4, 32)
        qh = b[..., 128:192].reshape(n, k // 256, 2, 1, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).view(4, 1)) & 3
        q = (low | (high << 4)).reshape(n, k // 256, 16, 16).float() - 32
        d = _f16(b[..., 208], b[..., 209])[..., None]
        w = (d * b[..., 192:208].contiguous().view(torch.int8).float())[..., None] * q
    return w.reshape(n, k)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k's and q5_k's 12 bytes [..., 12] -> six-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    lo, hi = s[..., 0:4], s[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), -1)
    m = torch.cat((s[..., 4:8] & 63, (hi >> 4) | ((s[..., 4:8] >> 6) << 4)), -1)
    return sc, m


def nvfp4_modelopt_torch(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """A ModelOpt NVFP4 weight -> float32 [N, K]: packed uint8 [N, K/2], scale float8_e4m3fn
    [N, K/16], scale_2 float32 (one value)."""
    n, half = packed.shape
    if packed.dtype != torch.uint8 or scale.shape != (n, half * 2 // 16):
        raise ValueError(f"NVFP4 packed [N, K/2] uint8 and scale [N, K/16]; got "
                         f"{packed.dtype} {list(packed.shape)} and {list(scale.shape)}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, half * 2).long()
    values = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=packed.device)[codes] * 0.5
    per = scale.float().repeat_interleave(16, dim=1)
    return values * per * scale_2.float().reshape(())


def quantize_nvfp4_torch(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> GGUF NVFP4 rows uint8 [N, K/64 * 36]. Per 16-value sub-block: the scale
    is the UE4M3 value next to amax / 6 (below or above, whichever reconstructs the sub-block
    with the smaller squared error; ties to the lower), each value the nearest E2M1 multiple of
    it (ties to the smaller magnitude). GGUF's NVFP4 has no tensor scale: a sub-block whose
    amax is under 6 * 2^-9 is stored in UE4M3's subnormals or as zeros."""
    n, k = w.shape
    row_bytes(FORMATS["nvfp4"], k)
    x = w.detach().float().reshape(n, k // 16, 16)
    table = ue4m3_table().to(x.device) * 2                                  # byte -> E4M3 value
    codes = torch.arange(0x7F, device=x.device)                              # 0x7F is NaN
    order = torch.argsort(table[codes], stable=True)
    values = table[codes][order]
    want = x.abs().amax(-1) / 6
    hi = torch.searchsorted(values, want.contiguous()).clamp(max=len(values) - 1)
    cand = torch.stack(((hi - 1).clamp(min=0), hi), -1)                        # [N, K/16, 2]
    scale = values[cand]                                                     # [N, K/16, 2]
    magnitudes = torch.tensor(E2M1_DOUBLED[:8], dtype=torch.float32, device=x.device) * 0.5
    q = _nearest(x.abs()[..., None, :] / torch.where(scale > 0, scale, 1)[..., None], magnitudes)
    q = torch.where(scale[..., None] > 0, q, 0)
    err = ((magnitudes[q] * scale[..., None] - x.abs()[..., None, :]) ** 2).sum(-1)
    pick = (err[..., 1] < err[..., 0]).long()                               # [N, K/16]
    byte = codes[order][cand.gather(-1, pick[..., None])[..., 0]].to(torch.uint8)
    mag = q.gather(-2, pick[..., None, None].expand(n, k // 16, 1, 16))[..., 0, :]
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    nib = (mag.to(torch.uint8) | sign).reshape(n, k // 64, 4, 16)
    qs = nib[..., :8] | (nib[..., 8:] << 4)                                  # [N, K/64, 4, 8]
    blocks = torch.cat((byte.reshape(n, k // 64, 4), qs.reshape(n, k // 64, 32)), -1)
    return blocks.reshape(n, k // 64 * 36)


def _nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The index of the nearest grid value (grid ascending), ties to the lower index."""
    mids = (grid[1:] + grid[:-1]) / 2
    return torch.searchsorted(mids, x.contiguous(), right=False)
