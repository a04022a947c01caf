"""A tiny LoRA adapter GGUF for a tiny base model, written at test time as llama.cpp's
convert_lora_to_gguf.py writes one: `general.type` adapter, `adapter.type` lora,
`adapter.lora.alpha`, and for each adapted matrix W (numpy [out, in]) `W.lora_a` [r, in] and
`W.lora_b` [out, r] (ggml order [in, r] and [r, out], what src/llama-adapter.cpp checks).
llama.cpp adds scale * alpha / r * B @ A x to W x."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import gguf
import numpy as np

TARGETS = ("attn_q", "attn_v", "ffn_down")


def write_tiny_lora(path: os.PathLike[str] | str, base: os.PathLike[str] | str, *, rank: int = 4,
                    alpha: float = 8.0, targets: Sequence[str] = TARGETS, std: float = 0.5,
                    seed: int = 1) -> Path:
    """An adapter of `rank` for every layer's `targets` matrices of the GGUF at `base` (shapes and
    architecture read from it), random A and B of `std`, large enough that scale 1 changes the
    greedy reply. Returns the path."""
    reader = gguf.GGUFReader(str(base))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in targets:
            n_in, n_out = (int(x) for x in t.shape[:2])   # ggml order: [in, out]
            w.add_tensor(f"{t.name}.lora_a", (rng.standard_normal((rank, n_in)) * std / np.sqrt(n_in)).astype(np.float32))
            w.add_tensor(f"{t.name}.lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
