"""The raw reference's timed loop, one for both workers: llama.cpp's (`raw._Llama`) and the torch
runner's (`raw_torch.TorchWorker`)."""
from __future__ import annotations

import time
from typing import Any


def timed_run(w: Any, seqs: list[list[int]], n_gen: int) -> tuple[list[float], float, float, list[list[int]]]:
    """Each sequence prefilled alone by `w.prefill` (its TTFT), then all decoded together by
    `w.step` for n_gen - 1 steps: (ttft_ms per sequence, rate per stream, aggregate rate, tokens
    per sequence). The llama.cpp worker's and the torch runner's (raw_torch.py) alike."""
    ttft, out = [], []
    for s, toks in enumerate(seqs):
        t0 = time.perf_counter()
        out.append([w.prefill(s, toks)])
        ttft.append(1000.0 * (time.perf_counter() - t0))
    pos = [len(t) for t in seqs]
    t0 = time.perf_counter()
    for _ in range(n_gen - 1):
        for s, tok in enumerate(w.step([(out[s][-1], pos[s], s) for s in range(len(seqs))])):
            out[s].append(tok)
            pos[s] += 1
    dt = time.perf_counter() - t0
    rate = (n_gen - 1) / dt if dt > 0 else 0.0
    return ttft, rate, rate * len(seqs), out
