#!/usr/bin/env python3
"""Would llama.cpp's own threadpool be a better neighbour than OpenMP's? (issue 47, "Sharing the
cores" in docs/performance.md). A llama-cpp-python decode loop on the embedded model (2 threads,
depth ~12), alone (64 tokens) and two at once (48 each, the slower one's rate), for:

  openmp spin       this project's build (libgomp's default wait)
  openmp passive    the same, OMP_WAIT_POLICY=PASSIVE (what --thread-wait passive sets)
  ggml pool ...     a build with -DGGML_OPENMP=OFF: llama.cpp's own threads, per graph (no
                    threadpool attached: what llama-cpp-python does), or a threadpool attached
                    with llama_attach_threadpool at a polling level (llama-server's --poll)

The variants rotate in every round; medians printed. Build the other venv first:

    python3 -m venv /tmp/venv-noomp && CMAKE_ARGS="-DGGML_OPENMP=OFF" /tmp/venv-noomp/bin/pip install \\
        --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36
    python scripts/openmp_off_check.py --noomp-python /tmp/venv-noomp/bin/python --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from appliance.models import embedded_model_path

LOOP = r"""
import ctypes, sys, time
from pathlib import Path
import llama_cpp

path, n, poll = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(path, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
if poll != "none":      # ggml's threadpool at this polling level (0: no polling, 100: aggressive)
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so.0"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so.0"), mode=ctypes.RTLD_GLOBAL)
    llama = ctypes.CDLL(str(lib / "libllama.so.0"), mode=ctypes.RTLD_GLOBAL)

    class Params(ctypes.Structure):     # ggml.h's ggml_threadpool_params (GGML_MAX_N_THREADS 512)
        _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                    ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]
    p = Params()
    base.ggml_threadpool_params_init(ctypes.byref(p), 2)
    p.poll = int(poll)
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    pool = cpu.ggml_threadpool_new(ctypes.byref(p))
    llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    llama.llama_attach_threadpool(llm._ctx.ctx, pool, pool)
llm.eval(llm.tokenize(b"Once upon a time there was a lighthouse keeper who"))
t0 = time.perf_counter()
for _ in range(n):
    llm.eval([llm.sample(temp=0)])
print(n / (time.perf_counter() - t0))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noomp-python", required=True, help="the python of a venv with a -DGGML_OPENMP=OFF build")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    variants = {"openmp spin": (sys.executable, "none", {}),
                "openmp passive": (sys.executable, "none", {"OMP_WAIT_POLICY": "PASSIVE"}),
                "ggml pool per graph": (args.noomp_python, "none", {}),
                "ggml pool poll 0": (args.noomp_python, "0", {}), "ggml pool poll 50": (args.noomp_python, "50", {})}

    def start(name: str, n: int) -> subprocess.Popen:
        python, poll, env = variants[name]
        return subprocess.Popen([python, "-c", LOOP, str(embedded_model_path()), str(n), poll],
                                stdout=subprocess.PIPE, text=True, env={**base, **env})

    def rate(p: subprocess.Popen) -> float:
        return float(p.communicate(timeout=1200)[0].strip())

    got: dict[str, dict[str, list[float]]] = {v: {"alone": [], "two": []} for v in variants}
    for r in range(args.rounds):
        for name in list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]:
            got[name]["alone"].append(rate(start(name, 64)))
            a, b = start(name, 48), start(name, 48)
            got[name]["two"].append(min(rate(a), rate(b)))
            print(f"round {r + 1} {name}: {got[name]['alone'][-1]:.1f} alone, {got[name]['two'][-1]:.1f} two at once",
                  file=sys.stderr, flush=True)
    print("| wait | one loop alone, tok/s | two at once, each |\n|---|---|---|")
    for name, d in got.items():
        cells = [f"{statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})" for v in (d["alone"], d["two"])]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
