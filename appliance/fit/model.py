"""What the fit planner knows of a model: its tensors (name, type, bytes, layer, role) and the
hyperparameters that size its KV cache, read from a GGUF's header without loading a weight.

A tensor's role decides where it may go and in what order it leaves a scarce device:

    embed          token_embd: llama.cpp keeps the input embedding in host memory always
    output         output_norm, output (the LM head): on the GPU only when every layer is
    attn           a layer's attention weights and norms (and everything else of the layer
                   that is neither FFN nor expert: layer norms, routers, biases)
    ffn            a layer's dense FFN (ffn_gate, ffn_up, ffn_down) and a MoE's shared expert
    expert         a layer's routed experts (ffn_{gate,up,down}_exps): each token reads only
                   k of them, so they are the first to stay in host memory
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..rope import ModelRope
from .gguf_header import StringArray, TensorInfo, read_header

ROLES = ("embed", "output", "attn", "ffn", "expert")
TIED_OUTPUT = "token_embd.weight (as output)"

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn_(gate|up|down|gate_up)_exps\b")
_FFN = re.compile(r"ffn_(gate|up|down)(_shexp)?\.|ffn_(gate|up|down)_shexp\b")


def role_of(name: str) -> tuple[int | None, str]:
    """(layer or None, role) of a tensor named as llama.cpp names them."""
    m = _LAYER.match(name)
    if m is None:
        return None, "embed" if name.startswith(("token_embd", "token_types", "position_embd")) else "output"
    rest = m.group(2)
    if _EXPERT.match(rest):
        return int(m.group(1)), "expert"
    if _FFN.match(rest):
        return int(m.group(1)), "ffn"
    return int(m.group(1)), "attn"


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: str
    nbytes: int
    layer: int | None
    role: str


@dataclass(frozen=True)
class ModelFacts:
    """A model as the planner sees it. `n_head_kv` is per layer (some models vary it), and a
    layer in `swa_layers` keeps only `sliding_window` positions of KV per sequence."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_ff: int                     # a dense FFN's width, or one expert's
    n_head_kv: tuple[int, ...]
    key_length: int
    value_length: int
    tensors: tuple[Tensor, ...]
    n_expert: int = 0
    n_expert_used: int = 0
    sliding_window: int = 0
    swa_layers: frozenset[int] = frozenset()
    rope: ModelRope | None = None      # the positions: trained context, RoPE scaling (None: n_ctx_train alone)

    @property
    def positions(self) -> ModelRope:
        return self.rope or ModelRope(n_ctx_train=self.n_ctx_train)

    @property
    def weight_bytes(self) -> int:
        """The file's tensors (a tied output is the embedding's bytes again, not counted)."""
        return sum(t.nbytes for t in self.tensors if t.name != TIED_OUTPUT)

    @property
    def is_moe(self) -> bool:
        return any(t.role == "expert" for t in self.tensors)

    def bytes_by(self, layer: int | None, role: str) -> int:
        return sum(t.nbytes for t in self.tensors if t.layer == layer and t.role == role)


SPLIT = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_parts(path: str | Path) -> list[Path]:
    """A split GGUF's parts (`NAME-00001-of-00003.gguf`, llama.cpp's gguf-split naming) beside
    the first; any other file is its own only part."""
    path = Path(path)
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def from_gguf(path: str | Path) -> ModelFacts:
    """Read a GGUF's tensor table and KV hyperparameters from its header (no tensor data).
    Raises OSError or ValueError when it is not a GGUF it can read. A split GGUF named by its
    first part is read whole: metadata from the first part, tensors from every part."""
    parts = split_parts(path)
    headers = [read_header(p) for p in (parts if len(parts) > 1 and all(p.is_file() for p in parts) else [path])]
    return from_header(Path(path).name, headers[0][0], [t for _, infos in headers for t in infos])


def from_header(name: str, meta: dict[str, object], infos: list[TensorInfo]) -> ModelFacts:
    """ModelFacts from a header's metadata and the tensor infos of all its parts."""

    def get(key: str, default=None):
        value = meta.get(key, default)
        return default if isinstance(value, StringArray) else value

    arch = str(get("general.architecture", "unknown"))
    n_layer = int(get(f"{arch}.block_count", 0))
    n_embd = int(get(f"{arch}.embedding_length", 0))
    n_head = get(f"{arch}.attention.head_count", 1)
    n_head0 = int(max(n_head) if isinstance(n_head, list) else n_head)
    head_kv = get(f"{arch}.attention.head_count_kv", n_head)
    head_kv = tuple(int(h) for h in head_kv) if isinstance(head_kv, list) else (int(head_kv),) * n_layer
    if len(head_kv) != n_layer:
        raise ValueError(f"head_count_kv has {len(head_kv)} entries for {n_layer} layers")
    k_len = int(get(f"{arch}.attention.key_length", n_embd // max(n_head0, 1)))
    v_len = int(get(f"{arch}.attention.value_length", k_len))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(get(f"{arch}.vocab_size", tokens.length if isinstance(tokens, StringArray) else len(tokens or ())))
    window = int(get(f"{arch}.attention.sliding_window", 0) or 0)
    tensors = []
    for t in infos:
        layer, role = role_of(t.name)
        tensors.append(Tensor(t.name, t.ggml_type, t.nbytes, layer, role))
    names = {t.name for t in tensors}
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if "output.weight" not in names and embd is not None:
        # tied embeddings: llama.cpp loads token_embd a second time as the output layer, on the
        # output's device (TENSOR_DUPLICATED)
        tensors.append(Tensor(TIED_OUTPUT, embd.ggml_type, embd.nbytes, None, "output"))
    return ModelFacts(
        name=name, arch=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab,
        n_ctx_train=int(get(f"{arch}.context_length", 0)), n_head=n_head0, n_head_kv=head_kv, n_ff=_n_ff(get, arch),
        key_length=k_len, value_length=v_len, tensors=tuple(tensors),
        n_expert=int(get(f"{arch}.expert_count", 0) or 0),
        n_expert_used=int(get(f"{arch}.expert_used_count", 0) or 0),
        sliding_window=window, swa_layers=_swa_layers(arch, n_layer, window), rope=ModelRope.from_meta(get, arch))


def _n_ff(get, arch: str) -> int:
    """A dense FFN's width, or for a MoE one expert's (what one token's FFN activations take)."""
    value = get(f"{arch}.expert_feed_forward_length", None) or get(f"{arch}.feed_forward_length", 0)
    return int(max(value) if isinstance(value, list) else value or 0)


def _swa_layers(arch: str, n_layer: int, window: int) -> frozenset[int]:
    """The layers that attend within a sliding window, for the archs whose pattern llama.cpp
    fixes in code (gpt-oss: every other layer, from the first)."""
    if window and arch == "gpt-oss":
        return frozenset(range(0, n_layer, 2))
    return frozenset()
