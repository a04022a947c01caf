"""The transformer, in one file: llama (SmolLM2, Llama 3, Mixtral), qwen2, qwen3, qwen3moe,
gemma3, gpt-oss.

Read top to bottom: RMSNorm, RoPE (both kinds), attention over the slot's KV, the SwiGLU MLP,
the MoE block and the model (its loading is in `build.py`; the config from GGUF metadata and
the registry of architectures are in `args.py`).

Numerics follow llama.cpp's so the two agree: the residual stream, norms, RoPE and softmax
run in float32, and only the matmul operands are in the compute dtype (llama.cpp also keeps
activations in float32 and its weights quantized). What differs per architecture is listed
in `ARCHS`.

Shape legend: N tokens in the call, D model width, H query heads, G KV heads, E head dim,
X experts, F MLP width, V vocabulary, L positions of a slot's KV in use.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from . import experts, grouped
from .rows import pad_rows, padded_rows
from .kv import KVPool
from .args import ARCHS, ArchSpec, ModelArgs  # noqa: F401  (the model's facts, re-exported)
from .weights import GGUFWeights


DECODE_ROWS = 16   # spans up to this long (decode steps, speculative verifies) share a forward
KEY_BLOCK = 64     # a row attends over the slot's keys padded to a multiple of this (masked past it)
MIN_ROWS = 8       # ... with at least this many query rows per KV head in each matmul
FLOAT32_KEYS = 1024   # ... in float32 up to this many keys, in the KV dtype past it


# -- building blocks -------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., C] float32; weight: [C] float32. x * rsqrt(mean(x^2) + eps) * w, composed in C++
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Linear:
    """y = x W^T (+ b): operands in the compute dtype, result in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias   # weight: [out, in]; bias: [out] float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y = F.linear(pad_rows(x).to(self.weight.dtype), self.weight)[:m].float()
        return y + self.bias if self.bias is not None else y


class Rope:
    def __init__(self, args: ModelArgs, freq_factors: torch.Tensor | None, device) -> None:
        self.kind, self.dim, r = args.spec.rope, args.rope_dim, args.rope
        i = torch.arange(0, self.dim, 2, dtype=torch.float64, device=device)
        inv = r.freq_base ** (-i / self.dim)                             # [E/2]
        if freq_factors is not None:                                     # Llama 3's rope_freqs
            inv = inv / freq_factors.to(torch.float64)
        # linear: every pair squeezed by freq_scale; YaRN: blended with 1 by pair (appliance/rope.py)
        self.inv_freq = inv * torch.tensor(r.pair_scale(self.dim), dtype=torch.float64, device=device)
        self.magnitude = r.magnitude()    # YaRN's attention temperature, carried by cos and sin
        self.cpu = None   # cpu_kernels.CpuKernels: the rotation in place, in one call

    def tables(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotation for each position: [N, 1, E/2] complex (cos + i sin of each angle)."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]   # [N, E/2]
        return torch.polar(torch.full_like(angles, self.magnitude), angles).to(torch.complex64)[:, None, :]

    def __call__(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, E] float32; rot: [N, 1, E/2] complex64. A pair (a, b) rotated by angle t
        # is (a + ib)(cos t + i sin t): one complex multiply per pair
        if self.cpu is not None:
            return self.cpu.rope_(x, rot, self.dim, self.kind != "norm")
        n, heads, e = x.shape
        part = x[..., :self.dim]
        if self.kind == "norm":       # pairs are adjacent: (x0, x1), (x2, x3), ...
            z = torch.view_as_complex(part.reshape(n, heads, self.dim // 2, 2).contiguous())
            out = torch.view_as_real(z * rot).reshape(n, heads, self.dim)
        else:                         # pairs are half a head apart: (x0, x_{E/2}), ...
            z = torch.complex(part[..., :self.dim // 2], part[..., self.dim // 2:])
            out = torch.view_as_real(z * rot).transpose(-1, -2).reshape(n, heads, self.dim)
        return torch.cat((out, x[..., self.dim:]), dim=-1) if self.dim < e else out


@dataclass(frozen=True)
class Segment:
    """One span's rows in the call: rows [row, row + n) are positions [start, start + n) of slot."""

    slot: int
    row: int
    n: int
    start: int


class Attention:
    def __init__(self, args: ModelArgs, layer: int, wqkv: Linear, wo: Linear,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> None:
        self.args, self.layer = args, layer
        self.wqkv, self.wo = wqkv, wo             # wqkv: Q, K and V stacked, one matmul
        self.q_norm, self.k_norm = q_norm, k_norm
        self.window = 0                           # a sliding-window layer's window (gemma3, gpt-oss), else 0
        self.sinks: torch.Tensor | None = None    # gpt-oss: each head's logit in its softmax's denominator [H]
        self.fused = None                         # fused.Fused: the kernels' Q/K and decode attention
        self.cpu = None                           # cpu_kernels' attention: short spans on a CPU
        self.span = None                          # cpu_kernels.CpuKernels: ... with RoPE and the KV store

    def __call__(self, x: torch.Tensor, segs: Sequence[Segment], rope: Rope, rot: torch.Tensor,
                 kv: KVPool) -> torch.Tensor:
        a = self.args
        n, h, g = x.shape[0], a.n_head, a.n_head_kv
        qkv = self.wqkv(x).view(n, h + 2 * g, a.head_dim)               # [N, H + 2G, E]
        if self.span is not None and all(s.n <= DECODE_ROWS for s in segs):
            return self.wo(self._spans(qkv, segs, rope, rot, kv))
        qk, v = qkv[:, :h + g], qkv[:, h + g:]                          # [N, H + G, E], [N, G, E]
        if self.fused is not None:
            qk = self.fused.qk(qk, rot, self.q_norm, self.k_norm)
        else:
            if self.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :h], self.q_norm, a.eps), rms_norm(qk[:, h:], self.k_norm, a.eps)), 1)
            qk = rope(qk, rot)                                           # Q and K in one call
        q, k = qk[:, :h], qk[:, h:]                                      # [N, H, E], [N, G, E]
        outs = []   # segments are the call's rows in order
        for s in segs:
            qs, ks, vs = (q, k, v) if s.n == n else (q[s.row:s.row + s.n], k[s.row:s.row + s.n], v[s.row:s.row + s.n])
            keys, values = kv.write(self.layer, s.slot, s.start, ks, vs)   # [G, L, E]
            outs.append(self._attend(qs, keys, values, s.start, kv, s.slot))
        return self.wo(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _spans(self, qkv: torch.Tensor, segs: Sequence[Segment], rope: Rope, rot: torch.Tensor,
               kv: KVPool) -> torch.Tensor:
        """Short spans on the CPU kernels: each span's RoPE, KV store and attention in one call,
        the same bits as the steps one by one (-> [N, H*E] in the matmuls' dtype)."""
        outs = []
        for s in segs:
            keys, values = kv.claim(self.layer, s.slot, s.start, s.n)
            rows = slice(s.row, s.row + s.n)
            outs.append(self.span.attend_span(qkv[rows], rot[rows], keys, values, s.start, rope.dim,
                                              rope.kind != "norm", self.args.n_head, self.args.scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def step(self, x: torch.Tensor, rot: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             kv: KVPool) -> torch.Tensor:
        """One token a row, its position and slot in tensors (a CUDA graph's decode step: no
        shape depends on a position, nothing is read back): x [B, D] -> [B, D]. Kernels only."""
        a, n = self.args, x.shape[0]
        h, g = a.n_head, a.n_head_kv
        qkv = self.wqkv(x).view(n, h + 2 * g, a.head_dim)
        qk = self.fused.qk(qkv[:, :h + g], rot, self.q_norm, self.k_norm)
        kv.write_rows(self.layer, slots, positions, qk[:, h:], qkv[:, h + g:])
        return self.wo(self.fused.attend_at(qk[:, :h], kv.k, kv.v, self.layer, slots, positions))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                kv: KVPool, slot: int) -> torch.Tensor:
        """q: [T, H, E]; keys, values: [G, L, E]. Every span attends row-wise, so a row depends
        on its position alone: short spans (decode steps, verifies) through the CPU kernel when
        it is on (`cpu_kernels`), else like prompt chunks through _attend_rows; a short span's
        rows then differ in bits from the same rows in a chunk, which the prompt cache's probe
        finds (it reuses leaving at least DECODE_ROWS + 1 rows). With the kernels, short spans
        take the fused decode attention and chunks SDPA (not chunk-invariant)."""
        t, length = q.shape[0], keys.shape[1]
        if self.fused is None:
            if self.cpu is not None and t <= DECODE_ROWS:   # each row over exactly its own keys
                return self.cpu(q.contiguous(), keys, values, start, self.args.scale)
            return self._attend_rows(q, start, kv, slot)
        if t <= DECODE_ROWS:
            return self.fused.attend_rows(q, start, kv.k, kv.v, self.layer, slot)
        mask = (torch.arange(length, device=q.device)[None, :]               # causal, queries at
                <= torch.arange(start, start + t, device=q.device)[:, None])  # start .. start+t-1
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(keys.dtype), keys[None], values[None], attn_mask=mask,
            scale=self.args.scale, enable_gqa=self.args.n_head != self.args.n_head_kv)
        return o[0].transpose(0, 1).reshape(t, -1).float()               # [T, H*E]

    def _attend_rows(self, q: torch.Tensor, start: int, kv: KVPool, slot: int) -> torch.Tensor:
        """Any span, exact by construction: the row at position p attends over the first
        ceil((p + 1) / KEY_BLOCK) key blocks, later positions masked, whatever other rows share
        the call. So a row's arithmetic (matmul shapes, softmax length) is the same in a
        one-token step, a k-token verify and any prompt chunk; the kernels used compute each
        row independently of the others (checked at start-up by probe.check_exact, and for
        prompt chunks by cache.invariance). Rows are grouped by their padded key length."""
        t = q.shape[0]
        ends = [min(kv.n_ctx, -(-(p + 1) // KEY_BLOCK) * KEY_BLOCK) for p in range(start, start + t)]
        outs, i = [], 0
        while i < t:  # rows sharing a padded key length, at most two groups for t <= KEY_BLOCK
            j = i
            while j < t and ends[j] == ends[i]:
                j += 1
            keys, values = kv.view(self.layer, slot, ends[i])
            outs.append(self._attend_block(q[i:j], keys, values, start + i))
            i = j
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_block(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Rows at positions start.. over keys [G, L, E], L their common padded key length: two
        matmuls over the KV heads (on CPU several times faster than SDPA for a few rows), the
        scale folded into Q, the causal mask on the last key block only (the rows all sit in it).
        Up to FLOAT32_KEYS keys (and always on a GPU) in float32, each head's query rows padded
        to at least MIN_ROWS (CPU float32 matmuls take another kernel below 6 rows, which would
        make a step differ from a verify row; tiny bfloat16 ones are 3x slower there); past it,
        where reading the KV is the cost, in the pool's dtype, rows padded as a linear layer's,
        scores one matmul per head (a batched one copied K). The path depends on position only."""
        a, t, length = self.args, q.shape[0], keys.shape[1]
        per, g, m = a.n_head // a.n_head_kv, a.n_head_kv, a.n_head // a.n_head_kv * t
        small = length <= FLOAT32_KEYS or keys.device.type != "cpu"
        dtype = torch.float32 if small else keys.dtype
        rows = max(m, MIN_ROWS) if small else padded_rows(m)
        # q: [T, H, E] -> [G, per * T, E]: each KV head's query heads, row-major by head then token
        qg = F.pad((q * a.scale).view(t, g, per, a.head_dim).permute(1, 2, 0, 3)
                   .reshape(g, m, a.head_dim).to(dtype), (0, 0, 0, rows - m))            # [G, rows, E]
        if small:
            keys, values = keys.float(), values.float()
            scores = torch.bmm(qg, keys.transpose(1, 2))                          # [G, rows, L]
        else:
            scores = qg.new_empty(g, rows, length)
            for h in range(g):
                torch.matmul(qg[h], keys[h].T, out=scores[h])
        tail = min(KEY_BLOCK, length)     # row i sees positions <= start + i
        hidden = _hidden(start - (length - tail), tail, t, q.device)
        scores[:, :m].view(g, per, t, length)[..., length - tail:].masked_fill_(hidden, float("-inf"))
        if self.window and start + t - 1 >= self.window:   # ... and > start + i - window (llama.cpp's SWA)
            slid = _hidden(start - self.window, length, t, q.device).logical_not()
            scores[:, :m].view(g, per, t, length).masked_fill_(slid, float("-inf"))
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)          # [G, rows, L]
        else:   # a sink column: each row's head's logit, in the normalisation only
            sink = F.pad(self.sinks.view(g, per, 1).expand(g, per, t).reshape(g, m, 1), (0, 0, 0, rows - m))
            probs = torch.softmax(torch.cat((scores, sink.to(scores.dtype)), -1), dim=-1, dtype=torch.float32)[..., :length]
        o = torch.bmm(probs if small else probs.to(values.dtype), values)[:, :m].float()
        return o.view(g, per, t, a.head_dim).permute(2, 0, 1, 3).reshape(t, -1)


@functools.lru_cache(maxsize=4096)
def _hidden(first: int, tail: int, t: int, device) -> torch.Tensor:
    """[T, tail] bool: key j of the last `tail` is past row i, at position first + i among them."""
    return torch.arange(tail, device=device)[None, :] > torch.arange(first, first + t, device=device)[:, None]


class MLP:
    def __init__(self, gate_up: Linear, down: Linear, gelu: bool = False) -> None:
        self.gate_up, self.down = gate_up, down   # gate_up: the two stacked, one matmul
        self.gelu = gelu                          # GELU's tanh form gates (gemma), else SiLU
        self.act = None                           # cpu_kernels' SwiGLU: [N, 2F] -> [N, F] in one call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            return self.down(self.act(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class MoE:
    """Top-k routing over X experts (softmax router, as llama.cpp's build_moe_ffn); the experts
    all resident (on the grouped kernel with the kernels on), or in an `experts.ExpertCache`."""

    def __init__(self, args: ModelArgs, router: Linear, gate: torch.Tensor | None, up: torch.Tensor | None,
                 down: torch.Tensor | None, layer: int = 0, offload: experts.ExpertCache | None = None,
                 kernel: grouped.GroupedExperts | None = None, biases: tuple | None = None) -> None:
        self.args, self.router, self.offload, self.kernel = args, router, offload, kernel
        self.biases = biases                              # gpt-oss: gate, up, down biases [X, F], [X, F], [X, D]
        self.layer = layer                                # its index among the model's MoE layers
        self.gate, self.up, self.down = gate, up, down    # [X, F, D], [X, F, D], [X, D, F]; else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)                      # [N, X]
        weights, chosen = torch.topk(probs, self.args.n_expert_used, dim=-1)   # [N, k]
        if self.args.spec.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.offload is not None:
            return self.offload.layer(self.layer, x, chosen, weights)
        if self.kernel is not None:                                        # the grouped kernel
            return self.kernel(x, chosen, weights)
        groups = experts.group_by_expert(chosen, self.args.n_expert)
        if self.biases is not None:
            return experts.moe_ffn(x, weights, groups, lambda e, h: experts.swiglu_oai(
                h.to(self.gate.dtype), self.gate[e], self.up[e], self.down[e], tuple(b[e] for b in self.biases)))
        return experts.moe_ffn(x, weights, groups, lambda e, h: experts.swiglu(
            h.to(self.gate.dtype), self.gate[e], self.up[e], self.down[e]))


class Block:
    def __init__(self, args: ModelArgs, attn: Attention, ffn: MLP | MoE, attn_norm: torch.Tensor,
                 ffn_norm: torch.Tensor) -> None:
        self.args, self.attn, self.ffn, self.attn_norm, self.ffn_norm = args, attn, ffn, attn_norm, ffn_norm
        self.norm = rms_norm                      # or the kernels' (fused.Fused.rms_norm, cpu_kernels)
        self.norm_ffn = rms_norm                  # ... before the feed-forward
        self.post: tuple[torch.Tensor, torch.Tensor] | None = None   # gemma's norms of each output

    def __call__(self, x, segs, rope, rot, kv) -> torch.Tensor:
        a = self.attn(self.norm(x, self.attn_norm, self.args.eps), segs, rope, rot, kv)
        h = x + (a if self.post is None else rms_norm(a, self.post[0], self.args.eps))
        f = self.ffn(self.norm_ffn(h, self.ffn_norm, self.args.eps))
        return h + (f if self.post is None else rms_norm(f, self.post[1], self.args.eps))

    def step(self, x, rot, positions, slots, kv) -> torch.Tensor:
        h = x + self.attn.step(self.norm(x, self.attn_norm, self.args.eps), rot, positions, slots, kv)
        return h + self.ffn(self.norm(h, self.ffn_norm, self.args.eps))


class Transformer:
    def __init__(self, args: ModelArgs, embed: torch.Tensor, blocks: list[Block], norm: torch.Tensor,
                 output: Linear, rope: Rope) -> None:
        self.args, self.embed, self.blocks = args, embed, blocks
        self.norm, self.output, self.rope = norm, output, rope
        self.final_norm = rms_norm                        # or cpu_kernels'
        self.experts: experts.ExpertCache | None = None   # expert offload, when on
        self.rope_swa: Rope | None = None                 # the sliding-window layers' rotation (gemma3)
        # gemma scales the embeddings by sqrt(D), in float32 as llama.cpp's ggml_scale
        self.embed_scale = float(torch.tensor(args.dim, dtype=torch.float32).sqrt()) if args.spec.gemma else None

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segs: Sequence[Segment],
                logit_rows: torch.Tensor, kv: KVPool) -> torch.Tensor:
        """tokens, positions: [N]; logit_rows: the rows whose logits are wanted -> [R, V] float32."""
        x = self.embed[tokens].float()                                      # [N, D]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = [(self.rope, self.rope.tables(positions))]
        if self.rope_swa is not None:
            ropes.append((self.rope_swa, self.rope_swa.tables(positions)))
        for block in self.blocks:
            rope, rot = ropes[1 if block.attn.window and self.rope_swa is not None else 0]
            x = block(x, segs, rope, rot, kv)
        x = self.output(self.final_norm(x[logit_rows], self.norm, self.args.eps))   # [R, V]
        cap = self.args.softcap
        return x if not cap else torch.tanh(x * (1.0 / cap)) * cap

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVPool) -> torch.Tensor:
        """A decode step of one token a row as `graphs.DecodeGraphs` captures it (kernels on, a
        dense model): tokens, positions, slots [B] -> logits [B, V] float32, the same bits as
        `forward` gives those rows."""
        x = self.embed[tokens].float()
        rot = self.rope.tables(positions)
        for block in self.blocks:
            x = block.step(x, rot, positions, slots, kv)
        return self.output(rms_norm(x, self.norm, self.args.eps))
