#!/usr/bin/env python3
"""What serving several models costs: time to first token for a model that must be loaded
first against one that is loaded, and the processes' memory with one and with two models
loaded (issue 20's figures).

    python scripts/model_pool_check.py --rounds 5

It makes a library in a temporary directory holding the embedded model a second time (a
hard link, so the same bytes under another name: "second"), serves it with `appliance serve`
(the embedded model the default, loaded at start), and per round: a streamed request to the
loaded default (warm TTFT), then `POST /api/models/unload` of "second" and a streamed request
to it (TTFT with its load), alternating which goes first. Each request asks for 8 tokens of
the same prompt at temperature 0. RSS is read with psutil: the server process, and each
engine process by the pid /health reports, once with only the default loaded and once with
both. Last, the engine's decode rate (200 tokens, ignore_eos) of the default alone and of both
models decoding at once (each engine has its own llama.cpp threads; on a CPU they share the
cores). Extra `serve` flags go after `--`.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

from appliance.library.index import Library
from appliance.models import EMBEDDED_ALIAS, embedded_model_path

PROMPT = [{"role": "user", "content": "Name three rivers in Europe."}]


def ttft(url: str, model: str) -> float:
    """Seconds to the first content chunk; the stream is read to its end, so the request is
    over (and its model idle) when this returns."""
    t0 = time.perf_counter()
    first = None
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{model}: no content")
    return first


def decode_rate(url: str, model: str, n: int = 200) -> float:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["timings"]["predicted_per_second"]


def rss(url: str, server_pid: int) -> dict[str, float]:
    out = {"server": psutil.Process(server_pid).memory_info().rss / 2**20}
    for m in requests.get(url + "/health", timeout=30).json()["models"]:
        if m.get("pid"):
            out[m["name"]] = psutil.Process(m["pid"]).memory_info().rss / 2**20
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8197)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pool-check-"))
    lib = tmp / "library"
    (lib / "local").mkdir(parents=True)
    second = lib / "local" / "second.gguf"
    os.link(embedded_model_path(), second)
    Library(lib).add("second", [second], "hf:local/second", {"repo": "local/second"})
    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "APPLIANCE_CACHE_DIR": str(tmp / "cache"), "APPLIANCE_PLAN": "off"}
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(args.port),
                             "--library", str(lib), *args.serve_args], env=env,
                            stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None:
                raise SystemExit((tmp / "server.log").read_text())
            time.sleep(0.5)
        ttft(url, EMBEDDED_ALIAS)                      # the first request of a process is slower
        one = rss(url, proc.pid)
        warm, cold = [], []
        for i in range(args.rounds):
            r = requests.post(url + "/api/models/unload", json={"model": "second"}, timeout=120)
            assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
            order = [("warm", EMBEDDED_ALIAS), ("cold", "second")][:: 1 if i % 2 == 0 else -1]
            for kind, model in order:
                (warm if kind == "warm" else cold).append(ttft(url, model))
        two = rss(url, proc.pid)
        alone = decode_rate(url, EMBEDDED_ALIAS)
        with cf.ThreadPoolExecutor(2) as ex:
            both = list(ex.map(lambda m: decode_rate(url, m), [EMBEDDED_ALIAS, "second"]))
        w, c = statistics.median(warm), statistics.median(cold)
        print(f"rounds {args.rounds}; TTFT loaded (the default) median {w * 1000:.0f} ms "
              f"[{min(warm) * 1000:.0f}-{max(warm) * 1000:.0f}], not loaded (load included) median "
              f"{c * 1000:.0f} ms [{min(cold) * 1000:.0f}-{max(cold) * 1000:.0f}], ratio {c / w:.1f}x")
        print("RSS MiB, one model loaded: " + ", ".join(f"{k} {v:.0f}" for k, v in one.items()))
        print("RSS MiB, two models loaded: " + ", ".join(f"{k} {v:.0f}" for k, v in two.items()))
        print(f"decode tokens/s: the default alone {alone:.1f}; both at once {both[0]:.1f} and {both[1]:.1f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
