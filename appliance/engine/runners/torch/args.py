"""What the torch runner needs to know of a model before building it: the architecture's
differences from llama (`ARCHS`) and the sizes, read from the GGUF's metadata (`ModelArgs`)."""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import ModelLoadError
from .weights import GGUFWeights


@dataclass(frozen=True)
class ArchSpec:
    rope: str               # "norm": rotate adjacent pairs; "neox": pairs half a head apart
    qk_norm: bool = False   # RMSNorm over each head's Q and K before RoPE (qwen3, qwen3moe)
    norm_topk: bool = True  # renormalise the top-k router weights to sum to one


# keyed by general.architecture; Mixtral is "llama" with experts
ARCHS = {
    "llama": ArchSpec(rope="norm"),
    "qwen2": ArchSpec(rope="neox"),
    "qwen3": ArchSpec(rope="neox", qk_norm=True),
    "qwen3moe": ArchSpec(rope="neox", qk_norm=True),
}


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    spec: ArchSpec
    n_layer: int
    dim: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ff: int
    eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float       # positions are multiplied by this (linear scaling: 1 / factor)
    n_ctx_train: int
    n_vocab: int
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0

    @classmethod
    def from_gguf(cls, w: GGUFWeights) -> "ModelArgs":
        arch = str(w.meta("general.architecture"))
        if arch not in ARCHS:
            raise ModelLoadError(f"{w.path}: architecture {arch!r} is not supported by the torch "
                                 f"runner (supported: {', '.join(sorted(ARCHS))})")

        def m(key: str, default=None):
            return w.meta(f"{arch}.{key}", default) if default is not None else w.meta(f"{arch}.{key}")

        dim, n_head = int(m("embedding_length")), int(m("attention.head_count"))
        n_head_kv = m("attention.head_count_kv", n_head)
        if isinstance(n_head_kv, list):
            raise ModelLoadError(f"{w.path}: per-layer KV head counts are not supported")
        head_dim = int(m("attention.key_length", dim // n_head))
        if int(m("attention.value_length", head_dim)) != head_dim:
            raise ModelLoadError(f"{w.path}: key and value head sizes differ, which is not supported")
        scaling = str(m("rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise ModelLoadError(f"{w.path}: RoPE scaling {scaling!r} is not supported")
        factor = float(m("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        n_expert = int(m("expert_count", 0))
        ff = int(m("feed_forward_length", 0))
        return cls(
            arch=arch, spec=ARCHS[arch], n_layer=int(m("block_count")), dim=dim, n_head=n_head,
            n_head_kv=int(n_head_kv), head_dim=head_dim, ff=ff,
            eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(m("rope.freq_base", 10000.0)),
            rope_dim=int(m("rope.dimension_count", head_dim)), rope_scale=1.0 / (factor or 1.0),
            n_ctx_train=int(m("context_length", 2048)), n_vocab=int(w.blocks("token_embd.weight").shape[0]),
            n_expert=n_expert, n_expert_used=int(m("expert_used_count", 0)),
            expert_ff=int(m("expert_feed_forward_length", ff)) if n_expert else 0)
