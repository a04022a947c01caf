"""What a GGUF's header says about a model, for the library's listing: the quant, the
architecture, the trained context, whether it carries a chat template, its parameters."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from gguf.constants import LlamaFileType

from ..fit.gguf_header import TensorInfo
from ..rope import ModelRope


@dataclass(frozen=True)
class Card:
    quant: str
    arch: str
    n_ctx_train: int
    chat_template: bool
    n_params: int
    rope_scaling: str = ""     # the GGUF's own RoPE scaling, which serve applies without flags ("" none)

    def to_dict(self) -> dict:
        return {"quant": self.quant, "arch": self.arch, "n_ctx_train": self.n_ctx_train,
                "chat_template": self.chat_template, "n_params": self.n_params, "rope_scaling": self.rope_scaling}

    def context(self) -> str:
        """The trained context, and how far the GGUF's own scaling takes it: "32,768 (yarn x4: 131,072)"."""
        return f"{self.n_ctx_train:,}" + (f" ({self.rope_scaling})" if self.rope_scaling else "")


def quant_of(meta: dict[str, object], infos: list[TensorInfo]) -> str:
    """`general.file_type` by llama.cpp's name for it (Q4_K_M, not MOSTLY_Q4_K_M); without the
    key, the type that holds most of the matrices' bytes."""
    ftype = meta.get("general.file_type")
    if isinstance(ftype, int):
        try:
            return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"file type {ftype}"
    by_type = Counter()
    for t in infos:
        if len(t.shape) >= 2:
            by_type[t.ggml_type] += t.nbytes
    return by_type.most_common(1)[0][0] if by_type else "unknown"


def card_of(meta: dict[str, object], infos: list[TensorInfo]) -> Card:
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) else "unknown"
    n_ctx = meta.get(f"{arch}.context_length", 0)
    template = meta.get("tokenizer.chat_template")
    rope = ModelRope.from_meta(meta.get, arch)
    return Card(quant=quant_of(meta, infos), arch=arch,
                n_ctx_train=n_ctx if isinstance(n_ctx, int) else 0,
                chat_template=isinstance(template, str) and bool(template.strip()),
                n_params=sum(math.prod(t.shape) for t in infos),
                rope_scaling=(f"{rope.kind} x{rope.factor:g}: {int((rope.orig_ctx or rope.n_ctx_train) * rope.factor):,}"
                              if rope.scaled else ""))


def human_params(n: int) -> str:
    """135M, 7.6B: as model names write them."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            value = n / div
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"

