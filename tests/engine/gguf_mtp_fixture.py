"""A tiny GGUF with a multi-token-prediction (next-n) block, written at test time.

The vendored llama.cpp (llama-cpp-python 0.3.36) runs an MTP draft head for the
architectures whose model file builds an `LLM_GRAPH_TYPE_DECODER_MTP` graph (see
docs/speculation.md). The smallest of them to write is GLM-4.5's `glm4moe`: plain attention,
one leading dense block, MoE blocks with a shared expert, and `nextn_predict_layers` extra
blocks after the trunk that carry `nextn.{eh_proj, enorm, hnorm}` beside an ordinary MoE
block. llama.cpp counts those blocks in `block_count`; the trunk is the first
`block_count - nextn_predict_layers`.

Shapes here (numpy order, rows = output features; GGUF stores them reversed):
  trunk block 0 (dense): attn_{q,k,v,output}, attn_norm, post_attention_norm, ffn_{gate,up,down}
  trunk block 1 (MoE) and the next-n block 2: the same attention, ffn_gate_inp [E, D],
      exp_probs_b [E], ffn_{gate,up}_exps [E, F, D], ffn_down_exps [E, D, F],
      ffn_{gate,up}_shexp [F, D], ffn_down_shexp [D, F]
  block 2 adds nextn.eh_proj [D, 2D], nextn.enorm [D], nextn.hnorm [D]

`write_split_mtp` writes the same model as llama.cpp's converter publishes it in two files: the
trunk and `mtp-NAME.gguf`, the next-n block with the embeddings, final norm and output.

The tokenizer is the embedded SmolLM2's (borrowed as gguf_fixtures does). Weights are random:
what the tests prove is that drafting never changes the output, and how often the head's
drafts are accepted, not that it predicts well. Nothing is written into the repository.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
from gguf.quants import quantize

from .gguf_fixtures import embedded_vocab_size, tokenizer_fields

MTP_ARCH = "glm4moe"
# With `agree`, every block's matrices are smaller (std AGREE_GAIN / sqrt(n_embd)) and the norms
# exactly 1: the logits of x_p lean on the head of x_p's embedding, and the next-n block, whose
# eh_proj passes the embedding on, predicts from the token it is fed much as the trunk does.
# At 0.7 greedy MTP drafts are accepted ~10-20% of the time (both the accept and the cut path)
# and replies still depend on the prompt; at 0.3-0.5 they are accepted ~50% but every prompt
# gets the same reply; at 1.0 almost never.
AGREE_GAIN = 0.7


@dataclass(frozen=True)
class MtpDims:
    n_layer: int = 2          # trunk blocks (block 0 dense, the rest MoE)
    n_nextn: int = 1          # next-n blocks after the trunk (llama.cpp drives one)
    n_embd: int = 128         # head_dim 32: a q8_0 KV needs heads of whole 32-blocks
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128           # the dense block's FFN width
    n_ff_exp: int = 32        # each expert's width (and the shared expert's)
    n_expert: int = 4
    n_expert_used: int = 2
    n_ctx: int = 2048

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _tensors(d: MtpDims, n_vocab: int, seed: int, agree: bool) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    std = (AGREE_GAIN if agree else 1.0) / math.sqrt(d.n_embd)

    def rand(*shape: int, s: float = std) -> np.ndarray:
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return np.ones(n, np.float32) if agree else (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    D, E, F, hd = d.n_embd, d.n_expert, d.n_ff_exp, d.head_dim
    yield "token_embd.weight", rand(n_vocab, D, s=1.0)
    yield "output_norm.weight", norm(D)
    yield "output.weight", rand(n_vocab, D, s=6.0 / math.sqrt(D))
    for i in range(d.n_layer + d.n_nextn):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", norm(D)
        yield p + "attn_q.weight", rand(d.n_head * hd, D)
        yield p + "attn_k.weight", rand(d.n_head_kv * hd, D)
        yield p + "attn_v.weight", rand(d.n_head_kv * hd, D)
        yield p + "attn_output.weight", rand(D, d.n_head * hd)
        yield p + "post_attention_norm.weight", norm(D)
        if i == 0:
            yield p + "ffn_gate.weight", rand(d.n_ff, D)
            yield p + "ffn_up.weight", rand(d.n_ff, D)
            yield p + "ffn_down.weight", rand(D, d.n_ff)
        else:
            yield p + "ffn_gate_inp.weight", rand(E, D)
            yield p + "exp_probs_b.bias", np.zeros(E, np.float32)
            yield p + "ffn_gate_exps.weight", rand(E, F, D)
            yield p + "ffn_up_exps.weight", rand(E, F, D)
            yield p + "ffn_down_exps.weight", rand(E, D, F)
            yield p + "ffn_gate_shexp.weight", rand(F, D)
            yield p + "ffn_up_shexp.weight", rand(F, D)
            yield p + "ffn_down_shexp.weight", rand(D, F)
        if i >= d.n_layer:
            # eh_proj maps [enorm(embedding of x_p); hnorm(trunk hidden at p-1)] to D; agreeing,
            # it passes the embedding on, so the head predicts from x_p as the trunk does
            yield p + "nextn.eh_proj.weight", (np.eye(D, 2 * D, dtype=np.float32) if agree
                                               else rand(D, 2 * D, s=1.0 / math.sqrt(2 * D)))
            yield p + "nextn.enorm.weight", norm(D)
            yield p + "nextn.hnorm.weight", norm(D)


# What each file of a split keeps, as llama.cpp's converter writes them (`--no-mtp`, `--mtp`):
# the trunk every tensor but the next-n block's; the head that block with the embeddings, the
# final norm and the output it reads.
HEAD_SHARED = ("token_embd.weight", "output_norm.weight", "output.weight")
PARTS = {"whole": lambda name, d: True,
         "trunk": lambda name, d: not name.startswith(f"blk.{d.n_layer}."),
         "head": lambda name, d: name in HEAD_SHARED or name.startswith(f"blk.{d.n_layer}.")}


def write_tiny_mtp(path: os.PathLike[str] | str, *, dims: MtpDims = MtpDims(), seed: int = 0,
                   mtp: bool = True, quant: str = "Q4_1", agree: bool = False, part: str = "whole") -> MtpDims:
    """Write a tiny glm4moe GGUF: with its next-n block (`mtp`), or the same trunk without one
    (llama.cpp then has nothing to draft with). Every matrix is stored as `quant` (norms and
    biases F32): with F32 matrices llama.cpp's k-row batch and its one-row step round
    differently (the start-up check sees 7e-6), with Q4_1, the embedded model's type, they
    agree bit for bit under a q8_0 KV, so speculation is exact there. `agree`: a head whose
    drafts the trunk mostly accepts (see AGREE_GAIN); else both are random and it hardly ever
    agrees. `part` (PARTS): the whole model, or one file of it split in two (the same metadata,
    the next-n layer count included, and the same weights as the whole one of this seed).
    Returns the dimensions."""
    d = dims if mtp else MtpDims(**{**dims.__dict__, "n_nextn": 0})
    n_vocab = embedded_vocab_size()
    w = gguf.GGUFWriter(os.fspath(path), MTP_ARCH)
    w.add_name("tiny-mtp" if mtp else "tiny-mtp-trunk")
    w.add_context_length(d.n_ctx)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer + d.n_nextn)
    w.add_uint32(f"{MTP_ARCH}.nextn_predict_layers", d.n_nextn)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d.head_dim)
    w.add_expert_count(d.n_expert)
    w.add_expert_used_count(d.n_expert_used)
    w.add_expert_feed_forward_length(d.n_ff_exp)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(1.0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{quant}"])
    for key, value, vtype, sub in tokenizer_fields():
        w.add_key_value(key, value, vtype, sub)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                        "{% endif %}")
    kind = gguf.GGMLQuantizationType[quant]
    keep = PARTS[part]
    for name, arr in _tensors(d, n_vocab, seed, agree):
        if not keep(name, d):
            continue
        if arr.ndim >= 2:
            w.add_tensor(name, quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return d


def write_split_mtp(folder: os.PathLike[str] | str, name: str = "tiny-glm-Q4_1", *, counted: bool = False,
                    **kw) -> tuple[Path, Path]:
    """The model of write_tiny_mtp(**kw) published in two files, as llama.cpp's converter does
    with `--no-mtp` and `--mtp`: the trunk `NAME.gguf` and the head's sidecar `mtp-NAME.gguf`,
    in `folder`. The converter's trunk no longer counts the next-n layers (block_count is the
    trunk's, no nextn_predict_layers); `counted` writes one that still does, without their
    tensors (llama.cpp loads that form too, as "trunk_only"). Returns (trunk, sidecar)."""
    trunk, head = Path(folder) / f"{name}.gguf", Path(folder) / f"mtp-{name}.gguf"
    if counted:
        write_tiny_mtp(trunk, part="trunk", **kw)
    else:
        write_tiny_mtp(trunk, mtp=False, **kw)
    write_tiny_mtp(head, part="head", **kw)
    return trunk, head
