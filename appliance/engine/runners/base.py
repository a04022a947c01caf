"""The ModelRunner protocol: what the scheduler needs from a backend, and nothing more.

A runner owns the weights and a KV pool of `n_slots` sequences of `n_ctx` positions each (or, with
`info.kv_unified`, one pool of `n_ctx` positions the sequences share). The
scheduler decides what runs; the runner only computes. A `Span` asks for the logits of some of
its last positions; the runner returns them as float32 rows, valid until the next `forward`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from ..types import LoraAdapter


@dataclass(frozen=True)
class FimTokens:
    """The model's fill-in-the-middle tokens (None: the vocabulary has none), which llama-server's
    /infill lays out around the code: [REP]repo [SEP]file ... [PRE]prefix [SUF]suffix [MID]."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    rep: int | None = None
    sep: int | None = None


@dataclass(frozen=True)
class RunnerInfo:
    backend: str
    model_path: str
    model_name: str
    arch: str
    n_vocab: int
    n_ctx: int                   # positions per slot (kv_unified: of the pool, which any one slot may fill)
    n_ctx_train: int
    n_slots: int
    eog_ids: frozenset[int]      # end-of-generation tokens (eos, eot, <|im_end|>, ...)
    bos_id: int | None
    add_bos: bool
    chat_template: str | None
    bos_text: str
    eos_text: str
    kv_bytes: int                # the whole pool, n_slots x n_ctx positions (kv_unified: n_ctx)
    settings: dict[str, Any] = field(default_factory=dict)   # threads, batch sizes, flash attn
    fingerprint: str = ""
    # where chat_template comes from: model (the GGUF), builtin:NAME or file:PATH (--chat-template),
    # fallback:chatml (the GGUF has none)
    chat_template_source: str = "model"
    placement: dict[str, Any] = field(default_factory=dict)  # devices, layers, overrides, bytes (llama.cpp)
    fim: FimTokens = field(default_factory=FimTokens)
    # one pool of n_ctx cells for every slot (llama.cpp's kv_unified): the scheduler counts its cells
    # (sched/kv_pool.py) and the runner's `kv_used(slot)` says how many a slot holds
    kv_unified: bool = False
    adapters: tuple[LoraAdapter, ...] = ()   # LoRA adapters loaded beside the model (--lora; llama.cpp)


@dataclass(frozen=True)
class Span:
    """Tokens for one slot at absolute positions start_pos.., with logits for the last `n_logits`."""

    slot: int
    tokens: tuple[int, ...]
    start_pos: int
    n_logits: int = 1
    # the LoRA adapters it runs under, (id, scale) with scale != 0 by id (engine/lora.py); the
    # adapters apply to the whole llama.cpp context, so one forward's spans share one set
    lora: tuple[tuple[int, float], ...] = ()


class ModelRunner(Protocol):
    info: RunnerInfo

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> bytes:
        """The bytes of these tokens' pieces, concatenated (may end inside a UTF-8 sequence)."""

    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        """Run the spans; returns one [n_logits, n_vocab] float32 array per span, in order."""

    def truncate(self, slot: int, n_keep: int) -> None:
        """Drop the slot's KV at positions >= n_keep."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make positions [0, n) of dst equal to src's (dst's other positions are dropped)."""

    def save(self, slot: int) -> bytes:
        """The slot's sequence state (its KV), restorable into any slot of a same-config runner."""

    def restore(self, slot: int, blob: bytes) -> None: ...

    def kv_used(self, slot: int) -> int:
        """Positions the slot holds in the KV pool (asked only of a runner with `info.kv_unified`)."""

    def kv_fingerprint(self) -> str:
        """What a saved state's validity depends on: the model file, n_ctx, the KV type, the
        engine's versions, and the settings that change the computed KV (batch shapes, kernels,
        threads). A state saved by a runner with another fingerprint is not restored."""

    def guidance_tokenizer(self) -> Any:
        """An llguidance LLTokenizer over this vocabulary (structured output masks)."""

    def close(self) -> None: ...
