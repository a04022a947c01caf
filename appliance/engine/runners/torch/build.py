"""Building a `model.Transformer` from a file, tensor by tensor: matrices kept quantized where
a kernel reads them as stored (`qlinear`), MoE experts on the grouped kernel or behind an
expert cache (`experts`), the architecture's extras (`args.ArchSpec`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from . import experts, grouped, qlinear
from .model import MLP, Attention, Block, Linear, ModelArgs, MoE, Rope, Transformer
from .weights import GGUFWeights


def load(w: GGUFWeights, args: ModelArgs, dtype: torch.dtype, device, int4: bool | str = False,
         offload: experts.OffloadSpec | None = None, gemm: qlinear.GemmChoice | None = None,
         fused=None) -> Transformer:
    """Build the model from the file, tensor by tensor (matrices in `dtype`, norms in float32), kept
    quantized where `qlinear.kept` can (`int4`: a str, the layout; `gemm`: the Triton kernels'); `fused`:
    norms, Q/K and decode attention on the kernels; `offload`: experts behind one `experts.ExpertCache`."""
    def mat(name: str, *shape: int) -> torch.Tensor:
        return w.load(name, shape, dtype, device)

    vec = functools.partial(_vec, w, device)

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
        blocks.append(Block(a, attn, ffn, vec(f"{p}.attn_norm.weight", a.dim),   # gpt-oss's pre-FFN norm: post_attention_norm
                            vec(f"{p}.{'post_attention' if a.spec.oai else 'ffn'}_norm.weight", a.dim)))
    out_name = "output.weight" if w.has("output.weight") else "token_embd.weight"   # tied in small models
    output, embed = qlinear.output_and_embedding(w.blocks(out_name), w.blocks("token_embd.weight"), (a.n_vocab, a.dim),
                                                 dtype, device, int4, lambda: mat("token_embd.weight", a.n_vocab, a.dim))
    output = output or Linear(embed if out_name == "token_embd.weight" else mat(out_name, a.n_vocab, a.dim))
    factors = vec("rope_freqs.weight", a.rope_dim // 2) if w.has("rope_freqs.weight") else None
    model = Transformer(a, embed, blocks, vec("output_norm.weight", a.dim), output, Rope(a, factors, device))
    plain = not (a.spec.gemma or a.spec.oai)   # one rotation, no window, no sinks: the fused attention's
    for b in blocks if fused is not None else ():   # norms, Q/K and decode attention on the kernels
        b.norm, b.norm_ffn, b.attn.fused = fused.rms_norm, fused.rms_norm, fused if plain else None
    _extras(model, vec, device)
    model.experts = _expert_cache(moes, host, offload, device, grouped=gemm is not None)
    return model


def _vec(w: GGUFWeights, device, name: str, n: int) -> torch.Tensor:
    return w.load(name, (n,), torch.float32, device)


def _extras(model: Transformer, vec, device) -> None:
    """gemma3's and gpt-oss's extras: the window of each sliding layer and their rotation
    (gemma3: rope.freq_base_swa, positions unscaled, as llama.cpp's get_rope_freq_base /
    get_rope_freq_scale give a sliding layer; gpt-oss: the others' unless the file names a base);
    gemma3's norms of its attention's and FFN's outputs; gpt-oss's attention sinks."""
    a = model.args
    for i, b in enumerate(model.blocks if a.spec.gemma or a.spec.oai else ()):
        b.attn.window = a.swa if a.swa_layers[i] else 0
        if a.spec.gemma:
            b.post = (vec(f"blk.{i}.post_attention_norm.weight", a.dim), vec(f"blk.{i}.post_ffw_norm.weight", a.dim))
        if a.spec.oai:
            b.attn.sinks = vec(f"blk.{i}.attn_sinks.weight", a.n_head)
    if any(a.swa_layers) and (a.spec.gemma or a.rope_base_swa not in (0.0, a.rope.freq_base)):
        rope = dataclasses.replace(a.rope, freq_base=a.rope_base_swa)
        swa = dataclasses.replace(a, rope=dataclasses.replace(rope, freq_scale=1.0) if a.spec.gemma else rope)
        model.rope_swa = Rope(swa, None, device)


def _expert_cache(moes: Sequence[MoE], host: list, offload: experts.OffloadSpec | None, device,
                  grouped: bool) -> experts.ExpertCache | None:
    """One cache for every MoE layer's routed experts (expert offload), when asked for."""
    if offload is None or not moes:
        return None
    cache = experts.ExpertCache(host, offload.slots, torch.device(device), offload.compute, offload.policy,
                                offload.costs, offload.n_seq, grouped=grouped,
                                biases=[m.biases for m in moes] if moes[0].biases is not None else None)
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
    bias = f"{p}.ffn_gate_inp.bias"
    router = Linear(w.load(f"{p}.ffn_gate_inp.weight", (x, d), torch.float32, device),
                    w.load(bias, (x,), torch.float32, device) if w.has(bias) else None)
    names = [f"{p}.ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
    on = "cpu" if host is not None else device   # an expert cache copies a slot's biases with its matrices
    biases = tuple(w.load(f"{p}.ffn_{n}_exps.bias", s, torch.float32, on)   # gpt-oss's, with its SwiGLU
                   for n, s in (("gate", (x, f)), ("up", (x, f)), ("down", (x, d)))) if a.spec.oai else None
    pinned = host is not None and torch.device(device).type == "cuda"   # for asynchronous copies
    if host is None and kernels:
        mats = grouped.block_mats(*(w.blocks(n) for n in names), d, f, device, biases)
        if mats is not None:
            return MoE(a, router, None, None, None, layer=layer, kernel=grouped.GroupedExperts(mats, x))
    exps = tuple(w.load(n, s, dtype, on) for n, s in zip(names, ((x, f, d), (x, f, d), (x, d, f))))
    if host is None and kernels:
        return MoE(a, router, None, None, None, layer=layer,
                   kernel=grouped.GroupedExperts(grouped.ExpertMats.dense(*exps, biases=biases), x))
    if host is None:
        return MoE(a, router, *exps, layer=layer, biases=biases)
    host.append(tuple(t.pin_memory() for t in exps) if pinned else exps)
    biases = tuple(b.pin_memory() for b in biases) if pinned and biases is not None else biases
    return MoE(a, router, None, None, None, layer=layer, biases=biases)
