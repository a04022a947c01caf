"""A request's LoRA adapter set: the adapters it runs under and their scales.

llama.cpp applies adapters to a whole context (`llama_set_adapters_lora`), so the set is what
the scheduler groups a step's requests by (one forward runs one set) and what the prompt cache
keys a slot's KV on (a state computed under one set is never reused under another). The set is
canonical: (id, scale) pairs by id, the adapters at scale 0 left out, so a request whose
adapters are all at 0 runs the base model, in the same step as requests without adapters."""
from __future__ import annotations

import math
from typing import Sequence

from ..errors import InvalidRequest
from .types import LoraAdapter

LoraSet = tuple[tuple[int, float], ...]
BASE: LoraSet = ()


def resolve(asked: Sequence[tuple[int, float]] | None, adapters: Sequence[LoraAdapter]) -> LoraSet:
    """The set a request runs under: its own scales (`lora`; an adapter it does not list at 0,
    as llama-server reads a request's), else each adapter's start scale. An id this model has no
    adapter for, or a scale that is not finite, is an InvalidRequest naming the field."""
    if asked is None:
        return tuple((a.id, a.scale) for a in adapters if a.scale != 0.0)
    scales: dict[int, float] = {}
    for i, (ident, scale) in enumerate(asked):
        if not 0 <= ident < len(adapters):
            have = f"ids 0..{len(adapters) - 1}" if adapters else "none: the server was started without --lora"
            raise InvalidRequest(f"lora[{i}].id: {ident} is not a LoRA adapter of this model ({have})",
                                 param=f"lora[{i}].id")
        if not math.isfinite(scale):
            raise InvalidRequest(f"lora[{i}].scale must be a finite number", param=f"lora[{i}].scale")
        scales[ident] = float(scale)
    return tuple(sorted((i, s) for i, s in scales.items() if s != 0.0))
