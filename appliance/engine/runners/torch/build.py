"""Building a `model.Transformer` from a file, tensor by tensor: matrices kept quantized where
a kernel reads them as stored (`qlinear`), MoE experts on the grouped kernel or behind an
expert cache (`experts`), the architecture's extras (`args.ArchSpec`)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import experts, grouped, qlinear
from .model import MLP, Attention, Block, Linear, ModelArgs, MoE, Rope, Transformer
from .weights import GGUFWeights


def load(w: GGUFWeights, args: ModelArgs, dtype: torch.dtype, device, int4: bool | str = False,
         offload: experts.OffloadSpec | None = None, gemm: qlinear.GemmChoice | None = None,
         fused=None) -> Transformer:
    """Build the model from the file, tensor by tensor (matrices in `dtype`, norms in float32).
    Kept quantized: with `int4` Q4_0/Q4_1/Q8_0 (`qlinear.Int4Linear`, a str its layout), with `gemm` every kernel format
    (`qlinear.BlockLinear`); `fused` (`fused.Fused`): norms, Q/K and decode attention on the
    kernels; `offload`: routed experts in host memory behind one `experts.ExpertCache`."""
    def mat(name: str, *shape: int) -> torch.Tensor:
        return w.load(name, shape, dtype, device)

    def vec(name: str, n: int) -> torch.Tensor:
        return w.load(name, (n,), torch.float32, device)

    def lin(names: str | Sequence[str], n_in: int, *n_outs: int) -> Linear | qlinear.Int4Linear | qlinear.BlockLinear:
        """One matmul for matrices that share their input, stacked along the output."""
        names = [names] if isinstance(names, str) else list(names)
        biases = [vec(f"{n}.bias", o) if w.has(f"{n}.bias") else torch.zeros(o, device=device)
                  for n, o in zip(names, n_outs)]
        bias = torch.cat(biases) if any(w.has(f"{n}.bias") for n in names) else None
        blocks = [w.blocks(f"{n}.weight") for n in names]
        kept = qlinear.kept(blocks, [(o, n_in) for o in n_outs], dtype, device, bias, int4, gemm)
        return kept or Linear(torch.cat([mat(f"{n}.weight", o, n_in) for n, o in zip(names, n_outs)]), bias)

    a, blocks, moes, host = args, [], [], []
    q_dim, kv_dim = a.n_head * a.head_dim, a.n_head_kv * a.head_dim
    for i in range(a.n_layer):
        p = f"blk.{i}"
        norms = ((vec(f"{p}.attn_q_norm.weight", a.head_dim), vec(f"{p}.attn_k_norm.weight", a.head_dim))
                 if a.spec.qk_norm else (None, None))
        attn = Attention(a, i, lin([f"{p}.attn_q", f"{p}.attn_k", f"{p}.attn_v"], a.dim, q_dim, kv_dim, kv_dim),
                         lin(f"{p}.attn_output", q_dim, a.dim), *norms)
        if a.n_expert:
            ffn: MLP | MoE = _moe(w, a, p, dtype, device, len(moes), host if offload is not None else None,
                                  kernels=gemm is not None)
            moes.append(ffn)
        else:
            ffn = MLP(lin([f"{p}.ffn_gate", f"{p}.ffn_up"], a.dim, a.ff, a.ff), lin(f"{p}.ffn_down", a.ff, a.dim),
                      gelu=a.spec.gemma)
        blocks.append(Block(a, attn, ffn, vec(f"{p}.attn_norm.weight", a.dim), vec(f"{p}.ffn_norm.weight", a.dim)))
    out_name = "output.weight" if w.has("output.weight") else "token_embd.weight"   # tied in small models
    output, embed = qlinear.output_and_embedding(w.blocks(out_name), w.blocks("token_embd.weight"), (a.n_vocab, a.dim),
                                                 dtype, device, int4, lambda: mat("token_embd.weight", a.n_vocab, a.dim))
    output = output or Linear(embed if out_name == "token_embd.weight" else mat(out_name, a.n_vocab, a.dim))
    factors = vec("rope_freqs.weight", a.rope_dim // 2) if w.has("rope_freqs.weight") else None
    model = Transformer(a, embed, blocks, vec("output_norm.weight", a.dim), output, Rope(a, factors, device))
    for b in blocks if fused is not None else ():   # norms, Q/K and decode attention on the kernels (one rotation, no window: not gemma's)
        b.norm, b.norm_ffn, b.attn.fused = fused.rms_norm, fused.rms_norm, None if a.spec.gemma else fused
    _gemma(model, vec, device) if a.spec.gemma else None
    model.experts = _expert_cache(moes, host, offload, device, grouped=gemm is not None)
    return model


def _gemma(model: Transformer, vec, device) -> None:
    """gemma3's extras: each block's norms of its attention's and its FFN's outputs, the window
    of its sliding layers, and their rotation (rope.freq_base_swa, positions unscaled: llama.cpp's
    get_rope_freq_base / get_rope_freq_scale for a sliding layer)."""
    a = model.args
    for i, b in enumerate(model.blocks):
        b.post = (vec(f"blk.{i}.post_attention_norm.weight", a.dim), vec(f"blk.{i}.post_ffw_norm.weight", a.dim))
        b.attn.window = a.swa if a.swa_layers[i] else 0
    if any(a.swa_layers):
        swa = dataclasses.replace(a, rope=dataclasses.replace(a.rope, freq_base=a.rope_base_swa, freq_scale=1.0))
        model.rope_swa = Rope(swa, None, device)


def _expert_cache(moes: Sequence[MoE], host: list, offload: experts.OffloadSpec | None, device,
                  grouped: bool) -> experts.ExpertCache | None:
    """One cache for every MoE layer's routed experts (expert offload), when asked for."""
    if offload is None or not moes:
        return None
    cache = experts.ExpertCache(host, offload.slots, torch.device(device), offload.compute, offload.policy,
                                offload.costs, offload.n_seq, grouped=grouped)
    for moe in moes:
        moe.offload = cache
    return cache


def _moe(w: GGUFWeights, a: ModelArgs, p: str, dtype: torch.dtype, device, layer: int,
         host: list | None, kernels: bool = False) -> MoE:
    """A layer's router (float32: a near-tie of two experts must not flip on rounding) and routed
    experts, gate [X, F, D], up [X, F, D], down [X, D, F]: on the device (with the kernels on, as
    the file's blocks where their format allows, on the grouped kernel), or appended to `host`
    for an expert cache (pinned beside a CUDA device, for asynchronous copies)."""
    x, f, d = a.n_expert, a.expert_ff, a.dim
    router = Linear(w.load(f"{p}.ffn_gate_inp.weight", (x, d), torch.float32, device))
    names = [f"{p}.ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
    if host is None and kernels:
        mats = grouped.block_mats(*(w.blocks(n) for n in names), d, f, device)
        if mats is not None:
            return MoE(a, router, None, None, None, layer=layer, kernel=grouped.GroupedExperts(mats, x))
    on = "cpu" if host is not None else device
    exps = tuple(w.load(n, s, dtype, on) for n, s in zip(names, ((x, f, d), (x, f, d), (x, d, f))))
    if host is None and kernels:
        return MoE(a, router, None, None, None, layer=layer, kernel=grouped.GroupedExperts(grouped.ExpertMats.dense(*exps), x))
    if host is None:
        return MoE(a, router, *exps, layer=layer)
    host.append(tuple(t.pin_memory() for t in exps) if torch.device(device).type == "cuda" else exps)
    return MoE(a, router, None, None, None, layer=layer)
