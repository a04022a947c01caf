"""Tensor tables of well-known models from their published shapes, without a byte of weights:
what `appliance fit --shape NAME` plans for a model not yet downloaded, and what the planner's
tests check placements against.

A table is built tensor by tensor as llama.cpp's converter names them, and typed the way the
published quantisation does: Q4_K_M is llama.cpp's mix (Q4_K, with Q6_K for the output and for
attn_v and ffn_down in the layers its `use_more_bits` picks: the first and last eighth and every
third in between), MXFP4 is gpt-oss's (routed experts in MXFP4, the other matrices Q8_0). Norms
and routers are F32. Biases, attention sinks and other tensors under a megabyte in all are left
out; the tests compare the totals with the published file sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gguf_header import nbytes
from .model import ModelFacts, Tensor, role_of


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    n_ff: int = 0                 # dense FFN width (0: every layer is MoE)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    qk_norm: bool = False         # qwen3: attn_q_norm, attn_k_norm
    sliding_window: int = 0       # gpt-oss: every other layer
    quant: str = "Q4_K_M"


SHAPES = {s.name: s for s in (
    Shape("Llama-3.1-8B-Q4_K_M", "llama", 32, 4096, 32, 8, 128, 128256, 131072, n_ff=14336),
    Shape("Llama-3.3-70B-Q4_K_M", "llama", 80, 8192, 64, 8, 128, 128256, 131072, n_ff=28672),
    Shape("Qwen3-30B-A3B-Q4_K_M", "qwen3moe", 48, 2048, 32, 4, 128, 151936, 40960,
          n_expert=128, n_expert_used=8, n_ff_exp=768, qk_norm=True),
    Shape("gpt-oss-120b-MXFP4", "gpt-oss", 36, 2880, 64, 8, 64, 201088, 131072,
          n_expert=128, n_expert_used=4, n_ff_exp=2880, sliding_window=128, quant="MXFP4"),
)}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _type(shape: Shape, name: str, layer: int | None) -> str:
    if name.endswith("norm") or name.endswith("gate_inp"):
        return "F32"
    if shape.quant == "MXFP4":
        return "MXFP4" if "_exps" in name else "Q8_0"
    if name == "output":
        return "Q6_K"
    if layer is not None and name.split(".")[-1] in ("attn_v", "ffn_down", "ffn_down_exps") \
            and _use_more_bits(layer, shape.n_layer):
        return "Q6_K"
    return "Q4_K"


def _matrices(s: Shape, i: int) -> list[tuple[str, int]]:
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [("attn_norm", s.n_embd), ("attn_q", s.n_embd * q), ("attn_k", s.n_embd * kv),
           ("attn_v", s.n_embd * kv), ("attn_output", q * s.n_embd), ("ffn_norm", s.n_embd)]
    if s.qk_norm:
        out += [("attn_q_norm", s.head_dim), ("attn_k_norm", s.head_dim)]
    if s.n_expert:
        e = s.n_expert * s.n_embd * s.n_ff_exp
        out += [("ffn_gate_inp", s.n_embd * s.n_expert), ("ffn_gate_exps", e), ("ffn_up_exps", e),
                ("ffn_down_exps", e)]
    else:
        out += [("ffn_gate", s.n_embd * s.n_ff), ("ffn_up", s.n_embd * s.n_ff), ("ffn_down", s.n_ff * s.n_embd)]
    return [(f"blk.{i}.{n}", k) for n, k in out]


def build(shape: Shape | str) -> ModelFacts:
    s = SHAPES[shape] if isinstance(shape, str) else shape
    named = [("token_embd", s.n_vocab * s.n_embd)]
    for i in range(s.n_layer):
        named += _matrices(s, i)
    named += [("output_norm", s.n_embd), ("output", s.n_vocab * s.n_embd)]
    tensors = []
    for name, n in named:
        layer, role = role_of(name + ".weight")
        kind = _type(s, name, layer)
        tensors.append(Tensor(name + ".weight", kind, nbytes(kind, n), layer, role))
    return ModelFacts(
        name=s.name, arch=s.arch, n_layer=s.n_layer, n_embd=s.n_embd, n_vocab=s.n_vocab,
        n_ctx_train=s.n_ctx_train, n_head=s.n_head, n_ff=s.n_ff_exp or s.n_ff, n_head_kv=(s.n_head_kv,) * s.n_layer, key_length=s.head_dim,
        value_length=s.head_dim, tensors=tuple(tensors), n_expert=s.n_expert, n_expert_used=s.n_expert_used,
        sliding_window=s.sliding_window,
        swa_layers=frozenset(range(0, s.n_layer, 2)) if s.sliding_window else frozenset())
