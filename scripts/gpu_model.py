#!/usr/bin/env python3
"""Models for a machine that gets the repository alone (the device machine of scripts/gpu_check.sh):
the embedded model's package is too large to travel there, so its tokenizer travels as a
vocab-only GGUF and the models are written there, random weights in a real model's shape.

    python3 scripts/gpu_model.py vocab OUT.gguf              # here: SmolLM2's tokenizer alone (~2 MB)
    APPLIANCE_FIXTURE_TOKENIZER=OUT.gguf \\
    python3 scripts/gpu_model.py model --shape smollm2-135m --quant Q4_1 MODEL.gguf

A shape is the model's architecture numbers (layers, widths, heads); `--quant` stores its layer
matrices in that type and the embedding and output in Q8_0, as the embedded SmolLM2 file is laid
out. Its weights are `tests/engine/gguf_fixtures.write_tiny`'s, scaled so that its logits mean
something (engines compared on it disagree where they compute differently). What such a model
times is a real one's bytes and arithmetic; what it says is gibberish.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.gguf_fixtures import tokenizer_fields, write_tiny  # noqa: E402

# the embedded SmolLM2-135M's numbers, and a Llama-3.2-1B-like model with SmolLM2's vocabulary
SHAPES = {
    "smollm2-135m": dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_ctx=8192),
    "llama-1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=8192),
}


def write_vocab(out: Path) -> Path:
    """A GGUF holding only the borrowed tokenizer's keys (no tensors): what
    APPLIANCE_FIXTURE_TOKENIZER reads."""
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value, vtype, sub in tokenizer_fields():
        w.add_key_value(key, value, vtype, sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vocab", help="write the borrowed tokenizer as a vocab-only GGUF")
    v.add_argument("out", type=Path)
    m = sub.add_parser("model", help="write a random-weight model of a named shape")
    m.add_argument("out", type=Path)
    m.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    m.add_argument("--quant", default="Q4_1", help="layer matrices' ggml type (Q4_0, Q4_1, Q8_0) or F32")
    m.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    if a.cmd == "vocab":
        path = write_vocab(a.out)
    else:
        quant = None if a.quant.upper() == "F32" else a.quant.upper()
        path = write_tiny(a.out, "llama", **SHAPES[a.shape], seed=a.seed, quant=quant,
                          name=f"random-{a.shape}-{a.quant.lower()}")
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
