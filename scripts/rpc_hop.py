#!/usr/bin/env python3
"""What the RPC hop costs (docs/several-machines.md, issue 52): the embedded model served by
`appliance serve` with every layer on this host's CPU, on one `appliance worker`, and split over
two, each configuration started in turn inside every round (rounds rotate the order), medians
printed. Per configuration: the prefill rate and time of a ~P-token prompt and the decode rate
of G greedy tokens (the server's timings), and the bytes the head sent to and got from its
workers per decode step, from the kernel's count on the workers' connections (`ss -ti`) across a
1-token and a (G+1)-token reply to the same prompt, prompt cache off.

    python scripts/rpc_hop.py --rounds 3 [--threads 1] [--prompt-tokens 512] [--gen 64]

Every process computes with --threads threads (the head's CPU device and each worker's), so the
local run and a split use the same cores; nothing else should run on the machine. Needs the RPC
build (scripts/rpc_check.sh makes .venv-rpc).
"""
from __future__ import annotations

import argparse
import re
import os
import socket
import statistics
import subprocess
import sys
import time

import requests
from thread_wait_check import Server   # scripts/: `appliance serve` on a free port, its plan off

from appliance.compute_settings import thread_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, requests.RequestException):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start")


def start_worker(threads: int) -> tuple[str, subprocess.Popen]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "appliance", "worker", "--port", str(port), "--threads", str(threads)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **thread_env("spin")})
    wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=0.5).close() is None, "a worker")
    return f"127.0.0.1:{port}", p


def tcp_bytes(port: int) -> tuple[int, int]:
    """(bytes received, bytes sent) over the worker's established connections on `port`, as the
    kernel counts them (`ss -ti`: tcp_info's bytes_received and bytes_sent; llama.cpp's RPC uses
    send and recv, which /proc/PID/io does not count)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    got = [sum(int(m) for m in re.findall(rf"\b{key}:(\d+)", out)) for key in ("bytes_received", "bytes_sent")]
    return got[0], got[1]


def measure(threads: int, workers: list[tuple[str, subprocess.Popen]], prompt: str, gen: int) -> dict[str, float]:
    flags = ["--n-ctx", "2048", "--n-threads", str(threads), "--prompt-cache", "off", "--speculate", "off"]
    if workers:
        flags += ["--rpc", ",".join(ep for ep, _ in workers), "--n-gpu-layers", "all"]
    srv = Server("spin", tuple(flags))
    try:
        srv.chat(4, prompt="Hello")                           # warm
        time.sleep(2)                                         # its idle work done
        ports = [int(ep.rsplit(":", 1)[1]) for ep, _ in workers]
        before = [tcp_bytes(port) for port in ports]
        one = srv.chat(1, ignore_eos=True, prompt=prompt)
        middle = [tcp_bytes(port) for port in ports]
        full = srv.chat(gen + 1, ignore_eos=True, prompt=prompt)
        after = [tcp_bytes(port) for port in ports]
    finally:
        srv.close()
    t = full["timings"]
    out = {"prompt_tokens": t["prompt_n"], "prefill_tok_s": t["prompt_per_second"], "prefill_ms": t["prompt_ms"],
           "decode_tok_s": t["predicted_per_second"]}
    if workers:     # the (G+1)-token reply less the 1-token one: G decode steps (received: from the head)
        to_w = sum((a[0] - m[0]) - (m[0] - b[0]) for b, m, a in zip(before, middle, after))
        from_w = sum((a[1] - m[1]) - (m[1] - b[1]) for b, m, a in zip(before, middle, after))
        n = one["timings"]["prompt_n"]        # the 1-token reply: the prefill, and one step
        out.update(bytes_to_workers_per_step=to_w / gen, bytes_from_workers_per_step=from_w / gen,
                   bytes_to_workers_per_prompt_token=sum(m[0] - b[0] for b, m in zip(before, middle)) / n,
                   bytes_from_workers_per_prompt_token=sum(m[1] - b[1] for b, m in zip(before, middle)) / n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="about this many prompt tokens")
    ap.add_argument("--gen", type=int, default=64)
    args = ap.parse_args()
    prompt = "The lighthouse keeper wrote in his log every night. " * max(1, args.prompt_tokens // 11)
    workers = [start_worker(args.threads) for _ in range(2)]
    configs = {"local CPU": [], "1 worker, all layers": workers[:1], "2 workers, all layers": workers}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    try:
        for r in range(args.rounds):
            names = list(configs)[r % len(configs):] + list(configs)[:r % len(configs)]
            for name in names:
                got[name].append(measure(args.threads, configs[name], prompt, args.gen))
                print(f"round {r + 1} {name}: {got[name][-1]}", file=sys.stderr, flush=True)
    finally:
        for _, p in workers:
            p.kill()
    keys = ["prompt_tokens", "prefill_tok_s", "prefill_ms", "decode_tok_s", "bytes_to_workers_per_step",
            "bytes_from_workers_per_step", "bytes_to_workers_per_prompt_token", "bytes_from_workers_per_prompt_token"]
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, runs in got.items():
        cells = []
        for k in keys:
            vals = [x[k] for x in runs if k in x]
            cells.append(f"{statistics.median(vals):,.1f} ({', '.join(f'{v:,.1f}' for v in vals)})" if vals else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
