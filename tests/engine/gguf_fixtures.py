"""GGUF files generated at test time: a tiny random-weight llama that llama.cpp loads, and
files that it must refuse. Nothing here is ever written into the repository; callers pass a
path under pytest's tmp_path.

The tiny model borrows the embedded SmolLM2's tokenizer (gpt2 BPE, 49152 tokens, ChatML
specials), so text round-trips and the chat template's special tokens exist. Its weights are
random: its output is gibberish, which is all the serving path needs to be exercised.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np

from appliance.models import embedded_model_path

ARCH = "llama"
GGUF_MAGIC = b"GGUF"

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


def tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every tokenizer.ggml.* key of the embedded SmolLM2 GGUF (read once per process)."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is None:
        reader = gguf.GGUFReader(embedded_model_path())
        _TOKENIZER_CACHE = [(name, *_field_value(f)) for name, f in reader.fields.items()
                            if name.startswith("tokenizer.ggml.")]
        del reader
    return _TOKENIZER_CACHE


def embedded_vocab_size() -> int:
    for name, value, _, _ in tokenizer_fields():
        if name == "tokenizer.ggml.tokens":
            return len(value)  # type: ignore[arg-type]
    raise AssertionError("the embedded GGUF has no tokenizer.ggml.tokens")


def write_tiny_llama(path: os.PathLike[str] | str, *, chat_template: str | None = None,
                     n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, n_ctx: int = 512, seed: int = 0) -> Path:
    """Write a random-weight llama-arch GGUF (F32) with SmolLM2's tokenizer; returns the path."""
    assert n_embd % n_head == 0 and n_head % n_head_kv == 0
    path = Path(path)
    head_dim = n_embd // n_head
    n_vocab = embedded_vocab_size()
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny-random-llama")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, value, vtype, sub in tokenizer_fields():
        w.add_key_value(name, value, vtype, sub)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    # numpy shapes are PyTorch's (rows = output features); GGUF stores them reversed
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output.weight", rand(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(n_head * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(n_embd, n_head * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(n_embd, n_ff))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
