"""What the device check (engine/device_check.py) costs at a model's first start on a GPU, from
the GGUF's tensor table alone: its CPU side computes about 100 tokens through every matrix of the
model on llama.cpp's CPU backend, 2 FLOPs per active weight per token, at a rate per core
measured here (docs/gpu.md, "The device check"). The device's side is not counted: a GPU the
model fits on does it in a fraction of that. For a dense 70B on 16 cores: about half a minute.
"""
from __future__ import annotations

from .gguf_header import nbytes
from .model import ModelFacts

CHECK_TOKENS = 101                 # CHECK_TEXT in SmolLM2's vocabulary (device_check.py)
# llama.cpp's CPU backend on a prompt, GFLOP/s per physical core: the development machine's
# (2-core AMD EPYC VM, AVX2, idle) prefill of the embedded model, 203 tokens/s, is 27; an
# AVX-512 server does more, a busy host less (docs/gpu.md, "The device check")
GFLOPS_PER_CORE = 25.0


def active_weights(m: ModelFacts) -> float:
    """The weights a token's matrix products read: every tensor but the embedding's lookup, the
    routed experts at n_expert_used of n_expert."""
    total = 0.0
    for t in m.tensors:
        if t.role == "embed":
            continue
        per = nbytes(t.ggml_type, 1 << 16) / (1 << 16)     # bytes per weight of its type
        share = m.n_expert_used / m.n_expert if t.role == "expert" and m.n_expert else 1.0
        total += t.nbytes / per * share
    return total


def check_seconds(m: ModelFacts, cores: int, tokens: int = CHECK_TOKENS) -> float:
    """The check's CPU side, estimated in seconds on `cores` physical cores."""
    return 2.0 * active_weights(m) * tokens / (max(1, cores) * GFLOPS_PER_CORE * 1e9)
