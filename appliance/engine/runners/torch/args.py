"""What the torch runner needs to know of a model before building it: the architecture's
differences from llama (`ARCHS`) and the sizes, read from the GGUF's metadata (`ModelArgs`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ....config import EngineConfig
from ....errors import ModelLoadError
from ....rope import ModelRope, RopeScaling, served
from .weights import GGUFWeights


@dataclass(frozen=True)
class ArchSpec:
    rope: str               # "norm": rotate adjacent pairs; "neox": pairs half a head apart
    qk_norm: bool = False   # RMSNorm over each head's Q and K before RoPE (qwen3, qwen3moe)
    norm_topk: bool = True  # renormalise the top-k router weights to sum to one
    gemma: bool = False     # embeddings x sqrt(D); RMSNorm after attention and after the FFN
                            # too; GELU (tanh) gate; sliding-window layers (gemma3)
    oai: bool = False       # gpt-oss: attention sinks, biased experts with the clamped SwiGLU,
                            # router bias, sliding-window layers; its pre-FFN norm is
                            # post_attention_norm


# keyed by general.architecture; Mixtral is "llama" with experts
ARCHS = {
    "llama": ArchSpec(rope="norm"),
    "qwen2": ArchSpec(rope="neox"),
    "qwen3": ArchSpec(rope="neox", qk_norm=True),
    "qwen3moe": ArchSpec(rope="neox", qk_norm=True),
    "gemma3": ArchSpec(rope="neox", qk_norm=True, gemma=True),
    "gpt-oss": ArchSpec(rope="neox", oai=True),
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
    rope_dim: int
    rope: RopeScaling       # the rotation served (`runner` resolves --rope-* against `rope_model`)
    rope_model: ModelRope   # what the GGUF says of its positions
    n_ctx_train: int
    n_vocab: int
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    attn_scale: float = 0.0         # Q's scale before attention; 0: 1 / sqrt(head_dim)
    swa: int = 0                    # the sliding window (positions a key stays visible), 0: none
    swa_layers: tuple[bool, ...] = ()   # which layers slide (they rotate with rope_base_swa)
    rope_base_swa: float = 0.0      # the sliding layers' rotation base; 0: the others' rotation
    softcap: float = 0.0            # final logits cap * tanh(logits / cap); 0: none

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def served(self, cfg: EngineConfig, path) -> tuple[int, ModelArgs]:
        """(positions per slot, these args with the rotation) `cfg`'s --n-ctx and --rope-* serve."""
        try:
            n_ctx, rope = served(cfg, self.rope_model)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        return n_ctx, dataclasses.replace(self, rope=rope)

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
        rope_model = ModelRope.from_meta(lambda k: w.meta(k, None), arch)
        try:
            n_ctx_rope = served(EngineConfig(n_ctx=0), rope_model)
        except ValueError as e:
            raise ModelLoadError(f"{w.path}: {e}") from None
        n_expert = int(m("expert_count", 0))
        ff = int(m("feed_forward_length", 0))
        return cls(
            arch=arch, spec=ARCHS[arch], n_layer=int(m("block_count")), dim=dim, n_head=n_head,
            n_head_kv=int(n_head_kv), head_dim=head_dim, ff=ff,
            eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_dim=int(m("rope.dimension_count", head_dim)), rope=n_ctx_rope[1], rope_model=rope_model,
            n_ctx_train=int(m("context_length", 2048)), n_vocab=int(w.blocks("token_embd.weight").shape[0]),
            n_expert=n_expert, n_expert_used=int(m("expert_used_count", 0)),
            expert_ff=int(m("expert_feed_forward_length", ff)) if n_expert else 0,
            **_extras(ARCHS[arch], m, int(m("block_count")), dim, n_head, head_dim))


def _extras(spec: ArchSpec, m, n_layer: int, dim: int, n_head: int, head_dim: int) -> dict:
    """gemma3's and gpt-oss's extras as llama.cpp reads them (models/gemma3.cpp,
    models/openai-moe.cpp, llama-hparams.cpp): a window from attention.sliding_window; layer il
    slides where il % pattern < pattern - 1 (attention.sliding_window_pattern, by default 6 for
    gemma3 and 2 for gpt-oss, or one flag a layer). gemma3's sliding layers rotate with
    rope.freq_base_swa (10,000 by default) and positions unscaled, gpt-oss's as the others
    unless rope.freq_base_swa says; gemma3's 27B (62 layers) scales Q by 1 / sqrt(D / H)."""
    if not (spec.gemma or spec.oai):
        return {}
    swa = int(m("attention.sliding_window", 0))
    pattern = m("attention.sliding_window_pattern", 6 if spec.gemma else 2)
    if isinstance(pattern, list):
        layers = tuple(bool(p) for p in pattern)[:n_layer]
    else:
        p = int(pattern)
        layers = tuple(p == 0 or il % p < p - 1 for il in range(n_layer))
    extras = {"swa": swa, "swa_layers": layers if swa > 0 else (False,) * n_layer,
              "rope_base_swa": float(m("rope.freq_base_swa", 10000.0 if spec.gemma else 0.0))}
    if spec.gemma:
        extras.update(softcap=float(m("final_logit_softcapping", 0.0)),
                      attn_scale=1.0 / math.sqrt(dim / n_head) if n_layer == 62 else 1.0 / math.sqrt(head_dim))
    return extras
