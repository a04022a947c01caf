"""GGUF files generated at test time: tiny random-weight models that llama.cpp loads, and
files that it must refuse. Nothing here is ever written into the repository; callers pass a
path under pytest's tmp_path.

The tiny models borrow the embedded SmolLM2's tokenizer (gpt2 BPE, 49152 tokens, ChatML
specials), so text round-trips and the chat template's special tokens exist. Their weights are
random. `write_tiny_llama` is the serving-path fixture (near-uniform gibberish);
`write_tiny(path, arch)` writes llama, qwen2, qwen3, qwen3moe or mixtral with weights scaled
so that llama.cpp's logits are a reference another engine can be compared against.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import gguf
from gguf.quants import quantize
import numpy as np

from appliance.models import embedded_model_path

ARCH = "llama"
GGUF_MAGIC = b"GGUF"

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "mixtral", "gemma3", "gpt-oss")
_FILE_ARCH = {"mixtral": "llama"}          # llama.cpp runs Mixtral as llama with experts
_QK_NORM_ARCHS = frozenset({"qwen3", "qwen3moe", "gemma3"})
# gemma3 and gpt-oss: every other layer slides over this many positions (not a multiple of the
# torch runner's 64-key blocks); gemma3's rotate with their own base, the others with 1e6, as
# Gemma 3's; gemma3's final logits soft-capped (Gemma 2's, which gemma3's loader reads too).
# gpt-oss: biased Q/K/V/output, router and experts, a sink logit per head, head_dim twice
# n_embd / n_head (as its 64 x 64 heads on 2,880)
GEMMA_WINDOW, GEMMA_SOFTCAP = 40, 60.0
_MOE_ARCHS = frozenset({"qwen3moe", "mixtral", "gpt-oss"})

# Weight scales of write_tiny. With N(0, 0.02) weights every block adds almost nothing to the
# embedding and the logits are nearly flat (top-1 decided by noise), so an engine compared
# against llama.cpp would agree by chance and a wrong RoPE or a skipped norm would go unseen.
# - layer matrices: std WEIGHT_GAIN / sqrt(n_embd), so each projection of an RMS-normed input
#   has O(1) entries: attention scores spread by about 1 (RoPE and q/k norms change the
#   pattern), and every block changes the residual as much as the embedding (EMBD_STD 1).
# - output.weight: std LOGIT_STD / sqrt(n_embd), so (after output_norm) the logits have std
#   about 6 over the 49152 tokens: at the defaults the top-1 minus top-2 gap has median
#   0.8-1.2 and the top probability median about 0.4, per arch (test_gguf_fixtures checks).
# - norm weights 1 + N(0, NORM_STD), so an engine that ignores one is seen to disagree.
# - qwen2's q/k/v biases N(0, _BIAS_STD): as large as the projections they shift, as in real
#   Qwen2 checkpoints, so an engine that drops them disagrees on most tokens.
WEIGHT_GAIN = 1.0
LOGIT_STD = 6.0
EMBD_STD = 1.0
NORM_STD = 0.1
_BIAS_STD = 0.5

_TOKENIZER_CACHE: list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]] | None = None


def _field_value(field: gguf.ReaderField) -> tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """A reader field as (value, type, array sub-type) that GGUFWriter.add_key_value writes back
    with the same types. String arrays are kept as raw bytes (field.parts[i] for i in field.data),
    so no token is re-encoded."""
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i].tobytes()) for i in field.data], main, sub
        return field.contents(), main, sub
    return field.contents(), main, None


def tokenizer_source() -> Path:
    """The GGUF whose tokenizer the fixtures borrow: the embedded SmolLM2, or the file that
    APPLIANCE_FIXTURE_TOKENIZER names (a vocab-only copy, `scripts/gpu_model.py vocab`, where
    the embedded model's package is not installed: a GPU machine that gets the tree alone)."""
    other = os.environ.get("APPLIANCE_FIXTURE_TOKENIZER")
    return Path(other) if other else embedded_model_path()


def tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every tokenizer.ggml.* key of the borrowed tokenizer's GGUF (read once per process)."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is None:
        reader = gguf.GGUFReader(tokenizer_source())
        _TOKENIZER_CACHE = [(name, *_field_value(f)) for name, f in reader.fields.items()
                            if name.startswith("tokenizer.ggml.")]
        del reader
    return _TOKENIZER_CACHE


def embedded_vocab_size() -> int:
    for name, value, _, _ in tokenizer_fields():
        if name == "tokenizer.ggml.tokens":
            return len(value)  # type: ignore[arg-type]
    raise AssertionError(f"{tokenizer_source()} has no tokenizer.ggml.tokens")


@dataclass(frozen=True)
class TinyDims:
    """The shapes of one tiny model (head_dim resolved, vocab from the borrowed tokenizer)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int            # dense FFN width; for the MoE archs, each expert's width
    n_ctx: int
    n_expert: int        # 0 for the dense archs
    n_expert_used: int
    head_dim: int
    n_vocab: int

    @property
    def file_arch(self) -> str:
        return _FILE_ARCH.get(self.arch, self.arch)


def tiny_dims(arch: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
              n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 512, n_expert: int = 4,
              n_expert_used: int = 2, head_dim: int | None = None) -> TinyDims:
    """Check the arguments of `write_tiny` and resolve head_dim (qwen3's default is twice
    n_embd / n_head, so the key_length path, where n_head * head_dim != n_embd, is exercised)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    if head_dim is None:
        head_dim = 2 * n_embd // n_head if arch in _QK_NORM_ARCHS | {"gpt-oss"} else n_embd // n_head
    # qwen2 sizes attn_output as {n_embd, n_embd}: it cannot have any other head_dim
    if arch == "qwen2" and head_dim * n_head != n_embd:
        raise ValueError("qwen2 needs head_dim == n_embd / n_head")
    if head_dim % 2:
        raise ValueError("RoPE needs an even head_dim")
    moe = arch in _MOE_ARCHS
    if moe and not 0 < n_expert_used <= n_expert:
        raise ValueError("need 0 < n_expert_used <= n_expert")
    return TinyDims(arch, n_layer, n_embd, n_head, n_head_kv, n_ff, n_ctx,
                    n_expert if moe else 0, n_expert_used if moe else 0, head_dim,
                    embedded_vocab_size())


class _Init:
    """Random tensors, drawn from one generator in the order they are asked for."""

    def __init__(self, seed: int, weight_std: float, norm_std: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.weight_std, self.norm_std = weight_std, norm_std

    def rand(self, *shape: int, std: float | None = None) -> np.ndarray:
        std = self.weight_std if std is None else std
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        # noise, so an engine that skips a norm's weight (or applies the wrong one) disagrees;
        # no draw at all when norm_std is 0, which keeps write_tiny_llama's stream unchanged
        if self.norm_std == 0:
            return np.ones(n, dtype=np.float32)
        return 1.0 + self.rand(n, std=self.norm_std)


MARKER_SLOTS = range(3, 17)   # SmolLM2's control tokens after <|endoftext|>, <|im_start|>, <|im_end|>


def _write_hparams(w: gguf.GGUFWriter, d: TinyDims, name: str, chat_template: str | None,
                   special_ids: dict[str, int] | None = None, add_bos: bool | None = None,
                   quant: str | None = None, markers: Sequence[str] = ()) -> None:
    w.add_name(name)
    w.add_context_length(d.n_ctx)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    # qwen3moe reads each expert's width from expert_feed_forward_length. Its
    # feed_forward_length is then unused by llama.cpp: write n_ff * n_expert_used, as in
    # Qwen3-30B-A3B (6144 = 768 x 8), which is also what llama.cpp's fallback for a missing
    # expert key (feed_forward_length / expert_used_count) turns back into n_ff, and which an
    # engine that sizes experts from the wrong key trips over. Mixtral (arch llama) has no
    # expert key: its experts are feed_forward_length wide.
    w.add_feed_forward_length(d.n_ff * d.n_expert_used if d.arch in ("qwen3moe", "gpt-oss") else d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5 if d.arch in ("llama", "mixtral") else 1e-6)
    w.add_rope_freq_base({"gemma3": 1e6, "gpt-oss": 150000.0}.get(d.arch, 10000.0))
    if d.arch == "gpt-oss":
        w.add_uint32("gpt-oss.attention.sliding_window", GEMMA_WINDOW)   # pattern 2 by default
    if d.arch == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window", GEMMA_WINDOW)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)   # layer il slides where il % 2 < 1
        w.add_float32("gemma3.rope.freq_base_swa", 10000.0)
        w.add_float32("gemma3.final_logit_softcapping", GEMMA_SOFTCAP)
    w.add_rope_dimension_count(d.head_dim)
    # without key_length llama.cpp takes head_dim = n_embd / n_head
    if d.arch in _QK_NORM_ARCHS or d.head_dim * d.n_head != d.n_embd:
        w.add_key_length(d.head_dim)
        w.add_value_length(d.head_dim)
    if d.n_expert:
        w.add_expert_count(d.n_expert)
        w.add_expert_used_count(d.n_expert_used)
        if d.arch in ("qwen3moe", "gpt-oss"):
            w.add_expert_feed_forward_length(d.n_ff)
    w.add_vocab_size(d.n_vocab)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{quant}" + ("_MOE" if quant == "MXFP4" else "")] if quant
                    else gguf.LlamaFileType.ALL_F32)
    overrides = {} if add_bos is None else {"tokenizer.ggml.add_bos_token": add_bos}
    assert len(markers) <= len(MARKER_SLOTS), f"at most {len(MARKER_SLOTS)} markers"
    for key, value, vtype, sub in tokenizer_fields():
        if key == "tokenizer.ggml.tokens" and markers:
            value = list(value)    # type: ignore[arg-type]
            for at, text in zip(MARKER_SLOTS, markers):
                value[at] = text.encode()
        if key not in overrides:
            w.add_key_value(key, value, vtype, sub)
    for key, flag in overrides.items():
        w.add_bool(key, flag)
    for kind, tok in (special_ids or {}).items():  # e.g. {"fim_pre": 6}: tokenizer.ggml.fim_pre_token_id
        w.add_uint32(f"tokenizer.ggml.{kind}_token_id", tok)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _attn_tensors(d: TinyDims, init: _Init, i: int) -> Iterator[tuple[str, np.ndarray]]:
    p, q_dim, kv_dim = f"blk.{i}.", d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    yield p + "attn_norm.weight", init.norm(d.n_embd)
    for t, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
        yield p + f"attn_{t}.weight", init.rand(rows, d.n_embd)
        if d.arch in ("qwen2", "gpt-oss"):  # optional in llama.cpp, but every Qwen2 checkpoint has them
            yield p + f"attn_{t}.bias", init.rand(rows, std=_BIAS_STD)
    yield p + "attn_output.weight", init.rand(d.n_embd, q_dim)
    if d.arch == "gpt-oss":
        yield p + "attn_output.bias", init.rand(d.n_embd, std=_BIAS_STD)
        yield p + "attn_sinks.weight", init.rand(d.n_head, std=1.0)
    if d.arch in _QK_NORM_ARCHS:  # RMSNorm over each head's head_dim, before RoPE
        yield p + "attn_q_norm.weight", init.norm(d.head_dim)
        yield p + "attn_k_norm.weight", init.norm(d.head_dim)
    if d.arch == "gemma3":        # RMSNorm of the attention's output, before the residual
        yield p + "post_attention_norm.weight", init.norm(d.n_embd)


def _ffn_tensors(d: TinyDims, init: _Init, i: int) -> Iterator[tuple[str, np.ndarray]]:
    p = f"blk.{i}."
    yield p + ("post_attention_norm.weight" if d.arch == "gpt-oss" else "ffn_norm.weight"), init.norm(d.n_embd)
    if not d.n_expert:
        yield p + "ffn_gate.weight", init.rand(d.n_ff, d.n_embd)
        yield p + "ffn_up.weight", init.rand(d.n_ff, d.n_embd)
        yield p + "ffn_down.weight", init.rand(d.n_embd, d.n_ff)
        if d.arch == "gemma3":
            yield p + "post_ffw_norm.weight", init.norm(d.n_embd)
        return
    # numpy (PyTorch) order; GGUF reverses it to ggml's {n_embd, n_ff, n_expert} etc.
    yield p + "ffn_gate_inp.weight", init.rand(d.n_expert, d.n_embd)
    yield p + "ffn_gate_exps.weight", init.rand(d.n_expert, d.n_ff, d.n_embd)
    yield p + "ffn_up_exps.weight", init.rand(d.n_expert, d.n_ff, d.n_embd)
    yield p + "ffn_down_exps.weight", init.rand(d.n_expert, d.n_embd, d.n_ff)
    if d.arch == "gpt-oss":
        yield p + "ffn_gate_inp.bias", init.rand(d.n_expert, std=_BIAS_STD)
        for n, width in (("gate", d.n_ff), ("up", d.n_ff), ("down", d.n_embd)):
            yield p + f"ffn_{n}_exps.bias", init.rand(d.n_expert, width, std=_BIAS_STD)


def tiny_tensors(d: TinyDims, *, seed: int = 0, weight_std: float | None = None,
                 embd_std: float = EMBD_STD, out_std: float | None = None,
                 norm_std: float = NORM_STD) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the model `write_tiny` writes, as (GGUF name, F32 array in numpy /
    PyTorch order: rows are output features; GGUF stores the shape reversed). weight_std
    (every layer matrix) defaults to WEIGHT_GAIN / sqrt(n_embd), out_std (output.weight) to
    LOGIT_STD / sqrt(n_embd): see the comment at the top for why."""
    if weight_std is None:
        weight_std = WEIGHT_GAIN / math.sqrt(d.n_embd)
    if out_std is None:
        out_std = LOGIT_STD / math.sqrt(d.n_embd)
    init = _Init(seed, weight_std, norm_std)
    yield "token_embd.weight", init.rand(d.n_vocab, d.n_embd, std=embd_std)
    yield "output_norm.weight", init.norm(d.n_embd)
    # always untied, at its own scale: llama.cpp would fall back to token_embd, but then an
    # engine that reads the embedding where it should read the head would still agree
    yield "output.weight", init.rand(d.n_vocab, d.n_embd, std=out_std)
    for i in range(d.n_layer):
        yield from _attn_tensors(d, init, i)
        yield from _ffn_tensors(d, init, i)


def write_tiny(path: os.PathLike[str] | str, arch: str, *, n_layer: int = 2, n_embd: int = 64,
               n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 512,
               n_expert: int = 4, n_expert_used: int = 2, head_dim: int | None = None,
               seed: int = 0, weight_std: float | None = None, embd_std: float = EMBD_STD,
               out_std: float | None = None, norm_std: float = NORM_STD,
               chat_template: str | None = None, name: str | None = None,
               split_max_tensors: int = 0, special_ids: dict[str, int] | None = None,
               pooling: str | None = None, add_bos: bool | None = None,
               rope_scaling: tuple[str, float] | None = None, quant: str | None = None,
               markers: Sequence[str] = ()) -> Path:
    """Write a random-weight F32 GGUF of `arch` (one of TINY_ARCHS) with SmolLM2's tokenizer
    that llama.cpp loads; returns the path. The weights are `tiny_tensors` (same arguments).
    "mixtral" is written as general.architecture "llama" with experts. With
    `split_max_tensors`, gguf-split's parts (`STEM-00001-of-0000N.gguf`); returns the first.
    `special_ids` names more special tokens of the borrowed vocabulary (fill-in-the-middle ones).
    `pooling` (none, mean, cls, last) writes `{arch}.pooling_type`, as an embedding model's GGUF has.
    `add_bos` overrides SmolLM2's tokenizer.ggml.add_bos_token (false): a tokenizer that adds its BOS.
    `rope_scaling` (type, factor) declares RoPE scaling of the n_ctx trained positions, as a
    converted YaRN checkpoint's GGUF does (rope.scaling.type, .factor, .original_context_length).
    `quant` (a ggml type gguf can quantize: Q4_0, Q4_1, Q8_0...) stores every layer matrix in that
    type and the embedding and output matrices in Q8_0, as the embedded SmolLM2 file is laid out
    (its layers Q4_1): a model of a real one's shape and bytes for timing, with random weights.
    `markers` (at most 14) replace the texts of SmolLM2's control tokens 3-16 (<repo_name>...), so
    that a chat format's markers (<|channel|>, <|call|>...) are single special tokens, as they are
    in the vocabularies of the models that write them."""
    d = tiny_dims(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                  n_ff=n_ff, n_ctx=n_ctx, n_expert=n_expert, n_expert_used=n_expert_used,
                  head_dim=head_dim)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), d.file_arch, split_max_tensors=split_max_tensors)
    _write_hparams(w, d, name or f"tiny-random-{arch}", chat_template, special_ids, add_bos, quant, markers)
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType[pooling.upper()])
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
        w.add_rope_scaling_orig_ctx_len(d.n_ctx)
    for tname, data in tiny_tensors(d, seed=seed, weight_std=weight_std, embd_std=embd_std,
                                    out_std=out_std, norm_std=norm_std):
        _add_tensor(w, tname, data, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return w.format_shard_names(path)[0]
    return path


def _add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, quant: str | None) -> None:
    """One tensor as F32 or, for a matrix under `quant`, quantized by gguf (see write_tiny);
    MXFP4: the experts only, as gpt-oss's files hold them."""
    if quant == "MXFP4":
        kind = gguf.GGMLQuantizationType.MXFP4
        w.add_tensor(name, *((quantize(data, kind),) if name.endswith("_exps.weight") else (data,)),
                     **({"raw_dtype": kind} if name.endswith("_exps.weight") else {}))
        return
    if quant is None or data.ndim != 2 or "_exps" in name:
        w.add_tensor(name, data)
        return
    kind = gguf.GGMLQuantizationType[quant if name.startswith("blk.") else "Q8_0"]
    w.add_tensor(name, quantize(data, kind), raw_dtype=kind)


def write_tiny_llama(path: os.PathLike[str] | str, *, chat_template: str | None = None,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, n_ctx: int = 512, seed: int = 0,
                     special_ids: dict[str, int] | None = None, add_bos: bool | None = None) -> Path:
    """Write a random-weight llama-arch GGUF (F32) with SmolLM2's tokenizer; returns the path.

    The serving-path fixture: every weight N(0, 0.02) and norms exactly one, so the file is the
    same, byte for byte, as before `write_tiny` existed (near-uniform gibberish that other tests
    have been tuned against). Use `write_tiny` for a model whose logits mean something."""
    return write_tiny(path, "llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                      n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, seed=seed, weight_std=0.02,
                      embd_std=0.02, out_std=0.02, norm_std=0.0, chat_template=chat_template,
                      name="tiny-random-llama", special_ids=special_ids, add_bos=add_bos)


def write_garbage(path: os.PathLike[str] | str, kind: str = "truncated", seed: int = 0) -> Path:
    """A file llama.cpp must refuse.

    kind="truncated": the GGUF magic and version, then a header that claims many tensors and
    key/values and ends mid-way through the first key. kind="random": random bytes (no magic).
    """
    path = Path(path)
    if kind == "truncated":
        data = (GGUF_MAGIC + struct.pack("<I", 3)          # magic, version
                + struct.pack("<QQ", 272, 33)                # n_tensors, n_kv
                + struct.pack("<Q", 1000) + b"general.arch")  # a key that claims 1000 bytes
    elif kind == "random":
        data = np.random.default_rng(seed).bytes(64 * 1024)
        if data[:4] == GGUF_MAGIC:  # astronomically unlikely, but never by accident a GGUF
            data = b"XXXX" + data[4:]
    else:
        raise ValueError(f"unknown garbage kind {kind!r}")
    path.write_bytes(data)
    return path


def random_blocks(qtype: gguf.GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [n, row bytes] of an [n, k] matrix of `qtype` (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K)
    with random codes and scales: any bytes are a valid block but its f16 scales, set to small
    positive values. For the K-quants, which gguf cannot quantize."""
    rng = np.random.default_rng(seed)
    per, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    Q = gguf.GGMLQuantizationType
    at = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2)}.get(qtype, (0,))
    for a in at:
        raw[..., a:a + 2] = rng.uniform(0.001, 0.05, raw.shape[:-1]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def corrupt_copy(src: os.PathLike[str] | str, dst: os.PathLike[str] | str, tensor: str) -> Path:
    """A copy of the GGUF at `src` whose one tensor's bytes are corrupted, and nothing else: an
    F32 or F16 tensor with every sign bit flipped (finite values, the weights negated), a
    quantized one zeroed (an all-zero block is valid in every ggml type). The device check's
    fault: the device loads the copy while the CPU reads the original."""
    from appliance.fit.gguf_header import read_header

    src, dst = Path(src), Path(dst)
    _, infos = read_header(src)
    info = next(t for t in infos if t.name == tensor)
    data = bytearray(src.read_bytes())
    span = np.frombuffer(memoryview(data)[info.offset:info.offset + info.nbytes], np.uint8).copy()
    if info.ggml_type in ("F32", "F16"):
        width = 4 if info.ggml_type == "F32" else 2
        span[width - 1::width] ^= 0x80            # little-endian: the sign bit is in the last byte
    else:
        span[:] = 0
    data[info.offset:info.offset + info.nbytes] = span.tobytes()
    dst.write_bytes(bytes(data))
    return dst
