#!/usr/bin/env python3
"""Decode rate of two copies of the code, served side by side, requests interleaved.

A refactor must not slow decoding (issue 15: 0.97-1.03). Two bench runs one after the other
cannot show that on a shared 2-core machine: its slow and fast periods last minutes and move
a whole run by 5-20% (measured: the same commit against itself, 0.97-1.03 per prompt set; old
against new in consecutive runs, 0.92-0.98 one time and level the next). This script starts
both servers at once (an idle server polls its pipe and costs nothing), then sends each prompt
to A and B in ABBA / BAAB order, one request at a time, so every slow period falls on both.

    git worktree add /tmp/before <commit>
    python scripts/ab_decode.py --a /tmp/before --b . --rounds 4

Each side is `python -m appliance serve --plan off --port P --speculate S` started from /tmp
with PYTHONPATH set to that tree, so the tree's own `appliance` package serves. Each request
is streamed with `temperature: 0` and `max_tokens` tokens. Per request it keeps the engine's
decode rate (the response's `timings.predicted_per_second`: decode time inside the engine's
steps) and the client's (content chunks after the first, over the time from the first to the
last). It prints, for both, the median per side, the ratio of medians B/A, and the median and
quartiles of the per-prompt paired ratios B/A. Greedy replies of the two sides must match
(a refactor keeps the output), which the script checks and reports.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from appliance.bench import prompt_sets

SETS = ("prose", "code", "editing-code", "tool-calls")


def start(tree: Path, port: int, speculate: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, "-m", "appliance", "serve", "--port", str(port), "--plan", "off",
           "--speculate", speculate, "--cache-dir", tempfile.mkdtemp(prefix="ab-cache-")]
    return subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"ab_decode: the server on port {port} did not become healthy")


def one(port: int, prompt: prompt_sets.Prompt, max_tokens: int) -> tuple[float, float, str]:
    """(engine decode tok/s, client decode tok/s, the reply's text) of one streamed request."""
    body = {"messages": list(prompt.messages), "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if prompt.tools:
        body["tools"] = list(prompt.tools)
    arrivals, text, timings = [], [], None
    with requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            if not raw.startswith(b"data: {"):
                continue
            chunk = requests.models.complexjson.loads(raw[6:])
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or "".join((tc.get("function") or {}).get("arguments") or ""
                                                        for tc in delta.get("tool_calls") or [])
                if piece:
                    arrivals.append(time.perf_counter())
                    text.append(piece)
    client = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 2 else float("nan")
    return float(timings["predicted_per_second"]), client, "".join(text)


def summary(label: str, a: list[float], b: list[float]) -> str:
    pairs = sorted(y / x for x, y in zip(a, b))
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return (f"{label}: A median {statistics.median(a):.2f} tok/s, B median {statistics.median(b):.2f} tok/s, "
            f"B/A of medians {statistics.median(b) / statistics.median(a):.4f}; paired B/A median {q[1]:.4f} "
            f"(quartiles {q[0]:.4f}-{q[2]:.4f}, n={len(pairs)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="source tree A (the baseline)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B (the change)")
    ap.add_argument("--rounds", type=int, default=4, help="passes over the prompts (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per request (default 128)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"prompt sets (default {','.join(SETS)})")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per set (default 2)")
    ap.add_argument("--speculate", default="auto", help="--speculate for both servers (default auto)")
    ap.add_argument("--ports", default="18441,18442")
    args = ap.parse_args(argv)
    prompts = [p for name in args.sets.split(",") for p in prompt_sets.load(name).prompts[:args.per_set]]
    logs = Path(tempfile.mkdtemp(prefix="ab-logs-"))
    ports = dict(zip("AB", map(int, args.ports.split(","))))
    procs = {s: start(tree, ports[s], args.speculate, logs / f"{s}.log") for s, tree in (("A", args.a), ("B", args.b))}
    try:
        for s in "AB":
            wait(ports[s], procs[s])
            one(ports[s], prompts[0], 8)  # warm-up
        got: dict[str, list[tuple[float, float, str]]] = {"A": [], "B": []}
        for rnd in range(args.rounds):
            for i, prompt in enumerate(prompts):
                for s in ("ABBA" if (rnd + i) % 2 == 0 else "BAAB"):
                    got[s].append(one(ports[s], prompt, args.tokens))
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(timeout=60)
    differ = sum(a[2] != b[2] for a, b in zip(got["A"], got["B"]))
    print(f"A={args.a} B={args.b} speculate={args.speculate} tokens={args.tokens} "
          f"prompts={len(prompts)} rounds={args.rounds} (two requests per prompt and round on each side)")
    print(summary("engine decode", [x[0] for x in got["A"]], [x[0] for x in got["B"]]))
    print(summary("client decode", [x[1] for x in got["A"]], [x[1] for x in got["B"]]))
    print(f"replies that differ between A and B: {differ} of {len(got['A'])}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
