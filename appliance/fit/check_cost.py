"""What the device check (engine/device_check.py) costs at a model's first start on a GPU, from
the GGUF's tensor table alone: its CPU side computes about 100 tokens through every matrix of the
model on llama.cpp's CPU backend, 2 FLOPs per active weight per token, at a rate per core
measured here (docs/gpu.md, "The device check"); where the whole model's CPU side would not fit
beside the plan's use of host memory, through its first and last layers and the output head. The device's side is not counted: a GPU the
model fits on does it in a fraction of that. For a dense 70B on 16 cores: about half a minute.
"""
from __future__ import annotations

from .gguf_header import nbytes
from .model import ModelFacts

CHECK_TOKENS = 101                 # CHECK_TEXT in SmolLM2's vocabulary (device_check.py)
EDGE = 2                           # engine/device_slice.py's: layers kept at each end
# llama.cpp's CPU backend on a prompt, GFLOP/s per physical core: the development machine's
# (2-core AMD EPYC VM, AVX2, idle) prefill of the embedded model, 203 tokens/s, is 27; an
# AVX-512 server does more, a busy host less (docs/gpu.md, "The device check")
GFLOPS_PER_CORE = 25.0


def active_weights(m: ModelFacts, layers: frozenset[int] | None = None) -> float:
    """The weights a token's matrix products read: every tensor but the embedding's lookup, the
    routed experts at n_expert_used of n_expert; with `layers`, only those layers' and the
    tensors outside any layer (the output head)."""
    total = 0.0
    for t in m.tensors:
        if t.role == "embed" or layers is not None and t.layer is not None and t.layer not in layers:
            continue
        per = nbytes(t.ggml_type, 1 << 16) / (1 << 16)     # bytes per weight of its type
        share = m.n_expert_used / m.n_expert if t.role == "expert" and m.n_expert else 1.0
        total += t.nbytes / per * share
    return total


def slice_layers(m: ModelFacts, edge: int = EDGE) -> frozenset[int]:
    """The layers the check compares where the whole model's CPU side does not fit: the first and
    last `edge` (engine/device_slice.py, which also keeps any MTP layers)."""
    return frozenset({*range(min(edge, m.n_layer)), *range(max(0, m.n_layer - edge), m.n_layer)})


def check_seconds(m: ModelFacts, cores: int, tokens: int = CHECK_TOKENS,
                  layers: frozenset[int] | None = None) -> float:
    """The check's CPU side, estimated in seconds on `cores` physical cores (`layers`: the slice's)."""
    return 2.0 * active_weights(m, layers) * tokens / (max(1, cores) * GFLOPS_PER_CORE * 1e9)
