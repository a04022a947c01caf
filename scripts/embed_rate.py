#!/usr/bin/env python3
"""Embeddings per second: a batch of N short texts in one /v1/embeddings request against the same
N texts sent one request at a time, side by side in one run.

The engine packs a request's inputs into one llama_decode per batch (engine/embed.py), so one
request of 64 texts is a forward or two; 64 requests are 64 forwards and 64 HTTP round trips.
Each round runs both, the order alternating from one round to the next, so a slow period of
this shared machine falls on both alike. Per round: embeddings per second of each, and their
ratio (batch / one at a time); then the median ratio with its range, the conditions (model,
backend, threads, n_batch, the embeddings context) and the largest difference between a text's
vector from the batch and alone.

    python scripts/embed_rate.py                  # starts `appliance serve --embedding-model chat`
    python scripts/embed_rate.py --serve-args "--model tiny.gguf --embedding-model embed.gguf"
    python scripts/embed_rate.py --url http://127.0.0.1:8080 --model nomic-embed-text
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import requests

from appliance.bench.client import LocalServer

SUBJECTS = ("the river", "a red kite", "my old laptop", "the night train", "this recipe", "the town hall",
            "a quiet street", "the last chapter")
VERBS = ("crossed", "outlived", "surprised", "waited for", "followed", "rebuilt", "ignored", "measured")


def texts(n: int) -> list[str]:
    """n short, different sentences (about 8 to 12 tokens each)."""
    return [f"{SUBJECTS[i % 8].capitalize()} {VERBS[i // 8 % 8]} {SUBJECTS[(i * 3 + 1) % 8]} on day {i}."
            for i in range(n)]


def post(base: str, model: str | None, inputs: list[str]) -> dict:
    r = requests.post(base + "/v1/embeddings", json={"input": inputs, **({"model": model} if model else {})},
                      timeout=600)
    r.raise_for_status()
    return r.json()


def vectors(got: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in got["data"]])


def batch(base: str, model: str | None, inputs: list[str]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    vecs = vectors(post(base, model, inputs))
    return len(inputs) / (time.perf_counter() - t0), vecs


def singles(base: str, model: str | None, inputs: list[str]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    vecs = [vectors(post(base, model, [t]))[0] for t in inputs]
    return len(inputs) / (time.perf_counter() - t0), np.array(vecs)


def conditions(base: str, model: str | None, inputs: list[str]) -> str:
    r = post(base, model, inputs)
    health = requests.get(base + "/health", timeout=10).json()
    row = next(m for m in health["models"] if m["name"] == r["model"])
    st = health.get("settings") or {}        # the default model's: serve's flags, which both take
    return (f"model {r['model']} ({'embedding model' if row['kind'] == 'embedding' else 'chat model, mean-pooled'}), "
            f"{health.get('backend')}, threads {st.get('n_threads')}/{st.get('n_threads_batch')}, n_batch "
            f"{st.get('n_batch')}, embeddings {row.get('embeddings')}; {len(inputs)} texts, "
            f"{r['usage']['prompt_tokens'] / len(inputs):.1f} tokens each on average")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `appliance serve`)")
    ap.add_argument("--model", help="the model to embed with (default: the server's choice for no model)")
    ap.add_argument("--texts", type=int, default=64, help="texts per round (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each running both ways (default 5)")
    ap.add_argument("--serve-args", default="--plan off --speculate off --n-slots 1 --embedding-model chat",
                    help="flags for the server it starts (default: %(default)s)")
    args = ap.parse_args(argv)
    inputs = texts(args.texts)
    server = None if args.url else LocalServer(args.serve_args.split())
    base = args.url or server.url
    try:
        what = conditions(base, args.model, inputs)          # also the warm-up
        ways = {"batch": batch, "one at a time": singles}
        rates: dict[str, list[float]] = {w: [] for w in ways}
        vecs: dict[str, np.ndarray] = {}
        for rnd in range(args.rounds):
            order = list(ways) if rnd % 2 == 0 else list(ways)[::-1]
            for way in order:
                rate, vecs[way] = ways[way](base, args.model, inputs)
                rates[way].append(rate)
            print(f"  round {rnd + 1} ({' then '.join(order)}): batch {rates['batch'][-1]:.1f}/s, one at a time "
                  f"{rates['one at a time'][-1]:.1f}/s, ratio {rates['batch'][-1] / rates['one at a time'][-1]:.2f}x")
    finally:
        if server is not None:
            server.stop()
    ratios = sorted(b / s for b, s in zip(rates["batch"], rates["one at a time"]))
    print(what)
    print(f"embeddings per second, median of {args.rounds} rounds: batch {statistics.median(rates['batch']):.1f}, "
          f"one at a time {statistics.median(rates['one at a time']):.1f}; ratio {statistics.median(ratios):.2f}x "
          f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}); largest |batch - alone| in a vector "
          f"{np.abs(vecs['batch'] - vecs['one at a time']).max():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
