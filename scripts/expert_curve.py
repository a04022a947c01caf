#!/usr/bin/env python3
"""The torch runner's expert cache on a tiny MoE fixture: decode rate and hit rate with the
cache at 100%, 50% and 25% of the experts, against every expert resident, on the shipped
prompt sets (issue 18's CPU measurement: on a CPU both "devices" are host memory, so the shape
of the curve is the finding, not the rate).

    python scripts/expert_curve.py --arch qwen3moe --prompts 2 --tokens 32

Every configuration is loaded at once and each prompt runs through all of them in a rotating
order, so the machine's slow periods fall on all (ratios against resident are per prompt,
then the median). Per configuration: the decode rate (greedy steps of one stream, wall time),
the hit rate of the decode steps and of the prefill, bytes copied and rows computed on the
host per decoded token. Greedy tokens must equal the resident runner's (checked, reported).
The fixture's weights are random: its router spreads tokens over experts more evenly than a
trained model's, which makes this a hard case for any cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.bench import prompt_sets  # noqa: E402
from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners import make_runner  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from tests.engine.gguf_fixtures import write_tiny  # noqa: E402


def configs(n_experts: int) -> dict[str, tuple[str, str]]:
    out = {"resident": ("off", "auto")}
    for share in (100, 50, 25):
        slots = str(n_experts * share // 100)
        for compute in ("cpu", "device"):
            out[f"{share}% {compute}"] = (slots, compute)
    return out


def prompts(n: int, limit: int) -> list[tuple[str, str]]:
    out = []
    for name in prompt_sets.DEFAULT_SETS:
        for p in prompt_sets.load(name).prompts[:n]:
            text = "\n".join(str(m.get("content") or "") for m in p.messages)
            out.append((name, text))
    return out


def run(r, ids: list[int], n: int) -> tuple[list[int], float, tuple[int, int], tuple[int, int, int]]:
    """Prefill, then n greedy steps: tokens, decode seconds, prefill (lookups, hits), decode
    (lookups, hits, bytes copied + host rows counted separately below)."""
    c = r.model.experts
    r.truncate(0, 0)
    before = c.stats() if c else None
    (out,) = r.forward([Span(0, tuple(ids), 0, 1)])
    mid = c.stats() if c else None
    toks = [int(np.argmax(out[-1]))]
    t0 = time.perf_counter()
    for i in range(n - 1):
        (out,) = r.forward([Span(0, (toks[-1],), len(ids) + i, 1)])
        toks.append(int(np.argmax(out[0])))
    dt = time.perf_counter() - t0
    if c is None:
        return toks, dt, (0, 0), (0, 0, 0, 0)
    end = c.stats()
    return (toks, dt, (mid.lookups - before.lookups, mid.hits - before.hits),
            (end.lookups - mid.lookups, end.hits - mid.hits, end.bytes_copied - mid.bytes_copied,
             end.host_rows - mid.host_rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3moe", choices=("qwen3moe", "mixtral"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, default=2)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per shipped set")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="the torch runner's device (auto: CUDA when present)")
    a = ap.parse_args()
    path = write_tiny(Path(tempfile.mkdtemp()) / f"{a.arch}.gguf", a.arch, n_layer=a.layers, n_embd=a.embd,
                      n_head=4, n_head_kv=2, n_ff=a.ff, n_ctx=1024, n_expert=a.experts, n_expert_used=a.used)
    total = a.layers * a.experts
    runners = {name: make_runner(EngineConfig(engine="torch", n_slots=1, n_ctx=1024, torch_dtype=a.dtype,
                                              torch_device=a.device, expert_cache=slots, expert_compute=compute), path, "curve")
               for name, (slots, compute) in configs(total).items()}
    names = list(runners)
    rate: dict[str, list[float]] = {n: [] for n in names}
    ratio: dict[str, list[float]] = {n: [] for n in names}
    agg = {n: np.zeros(6) for n in names}          # prefill lookups, hits, decode lookups, hits, bytes, host rows
    by_set: dict[str, dict[str, list[int]]] = {}
    same = {n: 0 for n in names}
    cases = prompts(a.prompts, a.max_prompt)
    for k, (set_name, text) in enumerate(cases):
        ids = runners["resident"].tokenize(text, add_special=True)[:a.max_prompt]
        got = {}
        for n in names[k % len(names):] + names[:k % len(names)]:   # rotate who goes first
            got[n] = run(runners[n], ids, a.tokens)
        for n, (toks, dt, pre, dec) in got.items():
            rate[n].append((a.tokens - 1) / dt)
            ratio[n].append(got["resident"][1] / dt)
            agg[n] += [*pre, *dec]
            same[n] += toks == got["resident"][0]
            s = by_set.setdefault(set_name, {}).setdefault(n, [0, 0])
            s[0] += pre[0] + dec[0]
            s[1] += pre[1] + dec[1]
    print(f"fixture: {a.arch}, {a.layers} layers x {a.experts} experts (k={a.used}), D={a.embd}, F={a.ff}, "
          f"{a.dtype}; {len(cases)} prompts (<= {a.max_prompt} tokens), {a.tokens} greedy tokens each")
    print(f"{'config':<14} {'decode tok/s':>12} {'vs resident':>11} {'hit prefill':>11} {'hit decode':>10} "
          f"{'KiB copied/tok':>14} {'host rows/tok':>13} {'same tokens':>11}")
    n_dec = len(cases) * (a.tokens - 1)
    for n in names:
        p_l, p_h, d_l, d_h, by, hr = agg[n]
        hit = lambda h, l: f"{h / l:.1%}" if l else "-"  # noqa: E731
        print(f"{n:<14} {statistics.median(rate[n]):>12.1f} {statistics.median(ratio[n]):>11.2f} "
              f"{hit(p_h, p_l):>11} {hit(d_h, d_l):>10} {by / 1024 / n_dec:>14.1f} {hr / n_dec:>13.2f} "
              f"{same[n]:>5}/{len(cases)}")
    bw = [r.expert_stats().copy_gb_per_s for r in runners.values() if r.expert_stats() is not None]
    print(f"device: {runners['resident'].info.settings['device']}; one expert's copy measured at start: "
          f"{statistics.median(bw):.2f} GB/s (median over the cached configurations)")
    print("\nhit rate by prompt set (prefill and decode):")
    cached = [n for n in names if n != "resident"]
    print(f"{'set':<16}" + "".join(f"{n:>13}" for n in cached))
    for set_name, per in by_set.items():
        print(f"{set_name:<16}" + "".join(f"{per[n][1] / per[n][0]:>13.1%}" for n in cached))
    for r in runners.values():
        r.close()


if __name__ == "__main__":
    main()
