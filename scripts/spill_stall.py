#!/usr/bin/env python3
"""How long a prompt-cache spill stalls another stream: the longest gap between two tokens of a
decoding stream while another slot's long prompt state is saved to the RAM and disk tiers,
against that stream's median gap.

A spill happens when a request needs a slot whose kept prompt blocks are in neither tier yet:
the engine saves the slot's state (the runner's `save`, on the engine thread: the llama.cpp
context is not thread-safe), puts it in the RAM tier and writes it to the disk tier, and every
other stream waits for whatever part of that runs on the step path. Per round, on a server with
two slots:

    A  a long prompt (a shared prefix and a round's own tail of two prefill chunks), one output
       token: its slot keeps the prompt's whole blocks
    B  a short prompt, streamed, --decode tokens with ignore_eos: the stream whose gaps count
    C  sent once B has streamed --after chunks: a short unrelated prompt, one output token. The
       only free slot is A's, so A's state spills before C can start.

Round 1 prefills A's whole prompt; later rounds restore the shared prefix from the RAM tier
and prefill only their tail, so every round spills a state of the full size that no tier holds
yet. Gaps are timed at the client, one per streamed chunk. Per round it prints B's median gap,
its longest gap while C was in flight (the spill), before C (the noise of this machine) and
after C (what the spill left running, such as a disk writer), and the spilled state's size
(the RAM tier's growth); then the medians over rounds and the conditions.

    python scripts/spill_stall.py                      # starts `appliance serve` itself
    python scripts/spill_stall.py --prompt-tokens 4000 --rounds 5
    cd /tmp/before && PYTHONPATH=. python /work/main/scripts/spill_stall.py   # another checkout

(`appliance serve` is started as `python -m appliance` in the current directory: run it from
the checkout to measure.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

import appliance
from appliance.bench.client import LocalServer

SENTENCES = ("The lighthouse keeper climbed the stairs every evening to light the lamp.",
             "Ships passed the rocks in the dark and the beam swept over the water.",
             "In winter the storms came from the west and the windows rattled all night.",
             "His logbook listed every vessel, its flag, its cargo and the hour it passed.")


@dataclass
class Round:
    gaps: list[tuple[float, float]] = field(default_factory=list)   # (start, end) of each gap, s
    c_sent: float = 0.0
    c_done: float = 0.0
    spill_bytes: int = 0

    def during(self) -> list[float]:
        """Gaps overlapping C's life: the admission that spills A's slot happens in there."""
        return [b - a for a, b in self.gaps if b > self.c_sent and a < self.c_done]

    def before(self) -> list[float]:
        """Gaps before C was sent: the noise of this machine."""
        return [b - a for a, b in self.gaps if b <= self.c_sent]

    def after(self) -> list[float]:
        """Gaps after C was answered: whatever the spill left running (a disk writer)."""
        return [b - a for a, b in self.gaps if a >= self.c_done]


def text_of(n_tokens: int, base: str, tokenize) -> str:
    """Numbered sentences until `tokenize` counts at least n_tokens (checked every 16 lines)."""
    lines, i = [], 0
    while True:
        lines.append(f"{base} {i}: {SENTENCES[i % 4]}")
        i += 1
        if i % 16 == 0 and len(tokenize("\n".join(lines))) >= n_tokens:
            return "\n".join(lines)


def post(base: str, body: dict) -> dict:
    r = requests.post(base + "/v1/completions", json={"temperature": 0, **body}, timeout=1800)
    r.raise_for_status()
    return r.json()


def stream_b(base: str, prompt: str, n: int, times: list[float], started: threading.Event, after: int) -> None:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
                if len(times) == after:
                    started.set()
    started.set()


def one_round(base: str, prefix: str, i: int, args: argparse.Namespace, tokenize) -> Round:
    tail = text_of(2 * args.chunk, f"Round {i} note", tokenize)
    post(base, {"prompt": prefix + "\n" + tail, "max_tokens": 1})       # A: its slot keeps its KV
    ram_before = health(base)["engine"]["ram_bytes"]
    times: list[float] = []
    started = threading.Event()
    b = threading.Thread(target=stream_b, args=(base, f"Tell me a long story, part {i}.", args.decode, times,
                                                started, args.after))
    b.start()
    started.wait()
    rnd = Round(c_sent=time.perf_counter())
    post(base, {"prompt": f"What is {i} plus {i}?", "max_tokens": 1})   # C: takes A's slot
    rnd.c_done = time.perf_counter()
    b.join()
    rnd.gaps = list(zip(times, times[1:]))
    rnd.spill_bytes = health(base)["engine"]["ram_bytes"] - ram_before
    return rnd


def health(base: str) -> dict:
    return requests.get(base + "/health", timeout=30).json()


def conditions(h: dict, args: argparse.Namespace) -> str:
    s = h.get("settings") or {}
    keys = ("backend", "n_ctx", "n_slots", "n_threads", "n_threads_batch", "kv_type", "flash_attn", "prefill_chunk")
    found = {k: s[k] for k in keys if k in s}
    return (f"model {h.get('model')}; n_slots 2, n_ctx {args.prompt_tokens + 2048} a slot; {found}; "
            f"prompt ~{args.prompt_tokens} tokens; disk tier in a temp dir")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=7000, help="A's prompt, in tokens (its KV is spilled)")
    ap.add_argument("--decode", type=int, default=160, help="B's output tokens")
    ap.add_argument("--after", type=int, default=40, help="B's chunks streamed before C is sent")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="the server's --prefill-chunk")
    ap.add_argument("--serve-args", default="", help="more flags for `appliance serve`")
    args = ap.parse_args(argv)
    serve = ["--n-slots", "2", "--n-ctx", str(args.prompt_tokens + 2048), "--prefill-chunk", str(args.chunk),
             "--speculate", "off", *args.serve_args.split()]
    with LocalServer(serve) as srv:
        base = srv.url

        def tokenize(text: str) -> list[int]:
            return requests.post(base + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]

        prefix = text_of(args.prompt_tokens - 2 * args.chunk, "Log", tokenize)
        rounds = []
        for i in range(args.rounds):
            rnd = one_round(base, prefix, i, args, tokenize)
            rounds.append(rnd)
            med = statistics.median(b - a for a, b in rnd.gaps)
            print(f"round {i}: spilled {rnd.spill_bytes / 1e6:.0f} MB; B's median gap {1e3 * med:.1f} ms, "
                  f"longest during the spill {1e3 * max(rnd.during(), default=0):.0f} ms, "
                  f"before it {1e3 * max(rnd.before(), default=0):.0f} ms, "
                  f"after it {1e3 * max(rnd.after(), default=0):.0f} ms", flush=True)
        h = health(base)
    median_gap = statistics.median(statistics.median(b - a for a, b in r.gaps) for r in rounds)
    stall = statistics.median(max(r.during(), default=0) for r in rounds)
    print(f"\nmedian over {len(rounds)} rounds: B's median gap {1e3 * median_gap:.1f} ms, longest gap during a "
          f"{statistics.median(r.spill_bytes for r in rounds) / 1e6:.0f} MB spill {1e3 * stall:.0f} ms "
          f"({stall / median_gap:.0f}x); longest before it "
          f"{1e3 * statistics.median(max(r.before(), default=0) for r in rounds):.0f} ms, after it "
          f"{1e3 * statistics.median(max(r.after(), default=0) for r in rounds):.0f} ms")
    print("conditions:", conditions(h, args))
    print("code:", Path(appliance.__file__).parent.parent)
    print("engine:", {k: v for k, v in h["engine"].items() if k.startswith(("ram_", "disk_"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
