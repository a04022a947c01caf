#!/usr/bin/env python3
"""What --thread-wait is worth (docs/performance.md, "Sharing the cores"), three ways, each wait
policy alternated inside every round and medians printed:

  loops     a llama-cpp-python decode loop on the embedded model, alone and two at once
  neighbour an appliance serving the embedded model answers one chat turn; the moment its reply
            ends (its settling work still to do), a decode loop starts beside it: the loop's
            rate, with the server under each --thread-wait (the loop waits as the server does)
  served    the appliance alone, a streamed greedy reply (ignore_eos): the decode rate its
            timings report, under each --thread-wait (what passive costs a lone engine)

    python scripts/thread_wait_check.py --rounds 3 [--only loops,neighbour,served]

Nothing else should run on the machine for `served` (it measures a lone engine); `loops` and
`neighbour` measure a crowd on purpose.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests

from appliance.compute_settings import THREAD_WAITS, thread_env
from appliance.models import embedded_model_path

LOOP = r"""
import sys, time
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
llm.eval(llm.tokenize(b"Once upon a time there was a lighthouse keeper who"))
n, t0 = int(sys.argv[2]), time.perf_counter()
for _ in range(n):
    llm.eval([llm.sample(temp=0)])
print(n / (time.perf_counter() - t0))
"""


def loop_env(wait: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return {**base, **thread_env(wait)}


def start_loop(wait: str, n: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOOP, str(embedded_model_path()), str(n)],
                            stdout=subprocess.PIPE, text=True, env=loop_env(wait))


def rate(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=900)
    return float(out.strip())


def loops(wait: str) -> dict[str, float]:
    alone = rate(start_loop(wait, 64))
    a, b = start_loop(wait, 48), start_loop(wait, 48)
    return {"alone": alone, "two_at_once": min(rate(a), rate(b))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`appliance serve` on a free port with one slot, its plan off (scripts/rpc_hop.py adds flags)."""

    def __init__(self, wait: str, flags: tuple[str, ...] = ()) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.tmp = tempfile.mkdtemp(prefix="thread-wait-")
        env = {**loop_env("spin"), "APPLIANCE_PLAN": "off", "APPLIANCE_CACHE_DIR": self.tmp}
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", self.url.rsplit(":", 1)[1],
                                      "--n-ctx", "4096", "--n-slots", "1", "--thread-wait", wait, *flags],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not start")

    def chat(self, tokens: int, ignore_eos: bool = False, prompt: str = "Tell me about lighthouses. " * 20) -> dict:
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": tokens, "ignore_eos": ignore_eos, "cache_prompt": False}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def neighbour(wait: str) -> dict[str, float]:
    srv = Server(wait)
    try:
        srv.chat(24)
        return {"loop_after_a_reply": rate(start_loop(wait, 48))}
    finally:
        srv.close()


def served(wait: str) -> dict[str, float]:
    srv = Server(wait)
    try:
        srv.chat(8)                                  # warm
        time.sleep(2)                                # its idle work done
        return {"served_decode": srv.chat(200, ignore_eos=True)["timings"]["predicted_per_second"]}
    finally:
        srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="loops,neighbour,served")
    args = ap.parse_args()
    kinds = {"loops": loops, "neighbour": neighbour, "served": served}
    for name in args.only.split(","):
        got: dict[str, dict[str, list[float]]] = {w: {} for w in THREAD_WAITS}
        for r in range(args.rounds):
            for wait in (THREAD_WAITS if r % 2 == 0 else THREAD_WAITS[::-1]):   # alternated
                for k, v in kinds[name](wait).items():
                    got[wait].setdefault(k, []).append(v)
        for wait, figures in got.items():
            for k, vs in figures.items():
                print(f"{name:10s} {wait:8s} {k:20s} median {statistics.median(vs):7.1f} tok/s  "
                      f"({', '.join(f'{v:.1f}' for v in vs)})", flush=True)


if __name__ == "__main__":
    main()
