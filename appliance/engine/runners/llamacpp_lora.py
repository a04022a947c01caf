"""LoRA adapters on the llama.cpp runner: loaded beside the model with `llama_adapter_lora_init`
(freed with it), and set on the context with `llama_set_adapters_lora` when a forward's set
differs from the last one's. Only adapters at a scale other than 0 are handed to llama.cpp, so a
set of zeros computes the base model's graph itself: the logits bit for bit as without adapters."""
from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp as L

from ...adapters import LoraFile
from ...errors import EngineFailure, ModelLoadError
from ..lora import BASE, LoraSet
from ..types import LoraAdapter


class Adapters:
    def __init__(self, model: L.llama_model_p, files: Sequence[LoraFile]) -> None:
        self.handles: list[L.llama_adapter_lora_p] = []
        for f in files:
            handle = L.llama_adapter_lora_init(model, f.path.encode())
            if not handle:   # the runner adds llama.cpp's reason: not an adapter, another arch, a missing tensor
                raise ModelLoadError(f"--lora {f.path}: llama.cpp could not load the adapter")
            self.handles.append(handle)
        self.listed = tuple(LoraAdapter(i, f.path, f.scale) for i, f in enumerate(files))
        self.current: LoraSet = BASE

    def apply(self, ctx: L.llama_context_p, lora: LoraSet) -> None:
        """Set `lora` on the context (nothing to do when it is the one set already)."""
        if lora == self.current:
            return
        n = len(lora)
        handles = (L.llama_adapter_lora_p_ctypes * n)(*(self.handles[i] for i, _ in lora))
        scales = (ctypes.c_float * n)(*(s for _, s in lora))
        if L.llama_set_adapters_lora(ctx, handles, n, scales) != 0:
            raise EngineFailure(f"llama.cpp refused the LoRA adapters {lora}")
        self.current = lora


def one_set(spans: Sequence) -> LoraSet:
    """The one adapter set of a forward's spans (the scheduler runs one set a step)."""
    sets = {s.lora for s in spans}
    if len(sets) > 1:
        raise EngineFailure(f"one forward was given spans under {len(sets)} LoRA adapter sets")
    return sets.pop() if sets else BASE
