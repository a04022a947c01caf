#!/usr/bin/env python3
"""Slots that share one KV pool (issue 50): llama.cpp's `kv_unified` against a stream per slot,
for one long stream beside idle slots and for every slot decoding at once.

    python scripts/kv_unified_check.py --rounds 3 [--slots 4] [--n-ctx 4096] [--depth 3000]

The engine gives each of its n slots its own KV stream of n_ctx positions (`kv_unified` off), so
an idle slot's memory is unused and one conversation cannot grow past n_ctx. With `kv_unified`
one buffer of n x n_ctx cells holds every sequence: a lone stream may use all of it. Per round,
alternating the order, each layout is loaded in a process of its own (the raw reference's
context: llama.cpp's low-level API, greedy, the embedded model unless --model) and times: one
stream prefilled to --depth and decoding 128 tokens while the other slots are empty, then every
slot prefilled to --depth / n and decoding 64 tokens together. The unified layout also decodes
one stream at 2 x n_ctx, which the split layout cannot hold. Medians with each round's value.
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import time

from appliance.models import embedded_model_path


def _run(model: str, unified: bool, slots: int, n_ctx: int, depth: int, conn) -> None:  # in a child
    import llama_cpp as L
    import numpy as np

    quiet = L.llama_log_callback(lambda *a: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp_ = L.llama_model_default_params()
    m = L.llama_model_load_from_file(model.encode(), mp_)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = n_ctx * slots, slots, unified
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = L.llama_init_from_model(m, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(m))
    batch = L.llama_batch_init(512, 0, slots)
    mem = L.llama_get_memory(ctx)

    def decode(entries):
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

    def rate(seqs: int, at: int, n: int) -> float:
        L.llama_memory_clear(mem, True)
        toks = [1000 + (i * 7) % 20000 for i in range(at)]
        last = []
        for s in range(seqs):
            for start in range(0, at, 512):
                end = min(at, start + 512)
                decode([(toks[p], p, s, p == at - 1) for p in range(start, end)])
            last.append(argmax(end - start - 1))
        t0 = time.perf_counter()
        for k in range(n):
            decode([(last[s], at + k, s, True) for s in range(seqs)])
            last = [argmax(s) for s in range(seqs)]
        return n * seqs / (time.perf_counter() - t0)

    try:
        out = {"one": rate(1, depth, 128), "all": rate(slots, depth // slots, 64)}
        if unified:
            out["one_long"] = rate(1, 2 * n_ctx, 64)
        conn.send(out)
    except Exception as e:  # noqa: BLE001 - said by the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})


def measure(model: str, unified: bool, a: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_run, args=(model, unified, a.slots, a.n_ctx, a.depth, child))
    p.start()
    got = parent.recv()
    p.join()
    if "error" in got:
        raise SystemExit(f"{'unified' if unified else 'split'}: {got['error']} (--depth + 128 must fit --n-ctx)")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=4096, help="positions per slot")
    ap.add_argument("--depth", type=int, default=3000, help="the lone stream's depth")
    a = ap.parse_args()
    rows: dict[str, dict[str, list[float]]] = {"split": {}, "unified": {}}
    for r in range(a.rounds):
        for name in (("split", "unified") if r % 2 == 0 else ("unified", "split")):
            for k, v in measure(a.model, name == "unified", a).items():
                rows[name].setdefault(k, []).append(v)
    print(f"{a.slots} slots x {a.n_ctx} positions, flash attention, 2 threads; tok/s, medians of {a.rounds} "
          "(each round's value)\n")
    print("| layout | one stream at depth %d | %d streams at %d each (aggregate) | one stream at %d |"
          % (a.depth, a.slots, a.depth // a.slots, 2 * a.n_ctx))
    print("|---|---|---|---|")
    for name, got in rows.items():
        cells = [f"{statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})" if v else "cannot hold it"
                 for v in (got.get("one"), got.get("all"), got.get("one_long"))]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
