"""Served decode rate vs llama.cpp called in-process, side by side in one run.

    python benchmarks/serve_vs_raw.py [--model PATH] [--runs 5] [--prompt-tokens 512] [--tokens 128]

Starts `appliance serve` (default settings unless flags say otherwise) and a raw worker
process that drives llama.cpp's low-level API directly with the same context parameters
(n_slots sequences x n_ctx, threads, batch sizes, no flash attention). Then, alternating
raw / served in each repeat on the same token sequence:
  - one greedy stream at a ~512-token depth: client decode rate (content tokens after the
    first / time from first to last token) against the raw rate measured the same way;
  - four concurrent streams: aggregate rate over the window where all four decode (after the
    last prompt is in, before the first stream ends), against the raw worker decoding the same
    four sequences together in one llama_decode per step; and each stream's own rate from its
    first to its last token (which includes waiting for the other prompts' chunks);
  - peak RSS (VmHWM) of the server and engine processes after a prompt that fills one
    slot's context.
Prints conditions first, then min / median / max, then the ratios.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import statistics
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ("The history of lighthouses is a history of engineering against the sea. Early towers burned "
        "wood or coal in open braziers; later ones used oil lamps with reflectors, then Fresnel lenses "
        "that gathered the light into beams visible for twenty miles. Keepers trimmed wicks, wound the "
        "clockwork that turned the lens, and logged the weather every few hours. ")


def make_prompt(tokens_wanted: int, seed: int) -> str:
    nonce = "".join(random.Random(seed).choices(string.ascii_lowercase, k=12))
    # ~75 tokens per TEXT repeat with this tokenizer; trimmed by the caller's tokenizer check
    reps = max(1, tokens_wanted // 70)
    return f"[{nonce}] " + TEXT * reps + "\nContinue the story:"


# -- the raw reference: llama.cpp's low-level API, nothing of ours -------------------------------

def raw_worker(conn, model_path: str, n_ctx: int, n_slots: int, threads: int, n_batch: int) -> None:
    import numpy as np
    import llama_cpp as L

    quiet = L.llama_log_callback(lambda *a: None)  # keep a reference: llama.cpp calls it later
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = n_ctx * n_slots, n_slots, False
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(n_batch, 0, n_slots)

    def tokenize(text):
        data = text.encode()
        buf = (L.llama_token * (len(data) + 16))()
        return list(buf[:L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)])

    def decode(entries):
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(entries)
        assert L.llama_decode(ctx, batch) == 0

    def text_of(ids):
        buf, pieces = ctypes.create_string_buffer(256), []
        for t in ids:
            n = L.llama_token_to_piece(vocab, t, buf, 256, 0, True)
            pieces.append(buf.raw[:n])
        return b"".join(pieces)

    def argmax(row):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).argmax())

    def prefill(seq, toks):
        L.llama_memory_seq_rm(mem, seq, -1, -1)
        for start in range(0, len(toks), n_batch):
            part = toks[start:start + n_batch]
            decode([(t, start + j, seq, start + j == len(toks) - 1) for j, t in enumerate(part)])
        return argmax(len(toks) - 1 - (len(toks) - 1) // n_batch * n_batch)

    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        kind, texts, n_gen = msg
        seqs = [tokenize(t) for t in texts]
        nxt = [prefill(s, toks) for s, toks in enumerate(seqs)]
        pos = [len(t) for t in seqs]
        out = [[t] for t in nxt]
        t0 = time.perf_counter()
        for _ in range(n_gen - 1):
            decode([(out[s][-1], pos[s], s, True) for s in range(len(seqs))])
            for s in range(len(seqs)):
                out[s].append(argmax(s))
                pos[s] += 1
        dt = time.perf_counter() - t0
        conn.send({"n_prompt": [len(t) for t in seqs], "texts": [text_of(o).decode(errors="replace") for o in out],
                   "rate": (n_gen - 1) / dt,
                   "aggregate": len(seqs) * (n_gen - 1) / dt})


# -- the served side --------------------------------------------------------------------------

def served_stream(url: str, text: str, n_gen: int) -> dict:
    body = {"prompt": text, "max_tokens": n_gen, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    stamps, usage, timings, parts = [], None, None, []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                parts.append(chunk["choices"][0]["text"])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                timings = chunk["timings"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    n = usage["completion_tokens"]
    return {"n_prompt": usage["prompt_tokens"], "tokens": n, "first": stamps[0], "last": stamps[-1],
            "stamps": stamps,
            "rate": (n - 1) / (stamps[-1] - stamps[0]), "engine_rate": timings["predicted_per_second"],
            "text": "".join(parts)}


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def summary(xs: list[float]) -> str:
    return f"{min(xs):7.1f} {statistics.median(xs):7.1f} {max(xs):7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--n-slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--skip-full-context", action="store_true")
    args = ap.parse_args()

    from appliance.models import resolve

    model_path = str(resolve(args.model).path)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(args.port),
                               "--n-ctx", str(args.n_ctx), "--n-slots", str(args.n_slots),
                               "--n-threads", str(args.threads), "--log-level", "warning"]
                              + (["--model", args.model] if args.model else []),
                              stdout=subprocess.DEVNULL)
    parent, child = mp.get_context("spawn").Pipe()
    raw = mp.get_context("spawn").Process(target=raw_worker, args=(child, model_path, args.n_ctx,
                                                                    args.n_slots, args.threads, 512))
    raw.start()
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise SystemExit("the raw llama.cpp worker did not start")
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.3)
        health = requests.get(url + "/health").json()
        one_raw, one_srv, one_eng, four_raw, four_srv, four_per = [], [], [], [], [], []
        same_text = 0
        for run in range(args.runs):
            text = make_prompt(args.prompt_tokens, seed=run)
            parent.send(("one", [text], args.tokens))
            r = parent.recv()
            s = served_stream(url, text, args.tokens)
            assert r["n_prompt"][0] == s["n_prompt"], (r["n_prompt"], s["n_prompt"])
            same_text += (r["texts"][0] == s["text"])
            one_raw.append(r["rate"]); one_srv.append(s["rate"]); one_eng.append(s["engine_rate"])
            texts = [make_prompt(args.prompt_tokens, seed=1000 * run + k) for k in range(4)]
            parent.send(("four", texts, args.tokens))
            r4 = parent.recv()
            results = [None] * 4

            def go(k):
                results[k] = served_stream(url, texts[k], args.tokens)

            threads = [threading.Thread(target=go, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            same_text += sum(t == x["text"] for t, x in zip(r4["texts"], results))
            # aggregate over the window where all four were decoding (after the last prefill,
            # before the first stream ended): content chunks received in it / its length
            lo, hi = max(x["first"] for x in results), min(x["last"] for x in results)
            in_window = sum(sum(1 for t in x["stamps"] if lo < t <= hi) for x in results)
            four_srv.append(in_window / (hi - lo) if hi > lo else float("nan"))
            four_per.append(statistics.median(x["rate"] for x in results))
            four_raw.append(r4["aggregate"])
            print(f"run {run + 1}/{args.runs}: one stream raw {r['rate']:.1f} served {s['rate']:.1f} tok/s; "
                  f"four streams raw {r4['aggregate']:.1f} served {four_srv[-1]:.1f} tok/s", file=sys.stderr)
        rss = None
        if not args.skip_full_context:
            n_full = args.n_ctx - 64
            text = make_prompt(n_full, seed=99)
            # trim to fit: the server counts the tokens exactly, and refuses an over-long prompt
            while True:
                resp = requests.post(url + "/v1/completions", timeout=900,
                                     json={"prompt": text, "max_tokens": 32, "temperature": 0})
                if resp.status_code == 200:
                    depth = resp.json()["usage"]["total_tokens"]
                    break
                text = text[: int(len(text) * 0.97)]
            h = requests.get(url + "/health").json()
            rss = {"server": peak_rss(server.pid), "engine": peak_rss(h["engine_pid"]), "depth": depth}
    finally:
        parent.send(None)
        raw.join(30)
        server.terminate()
        server.wait(30)

    print(f"\nconditions: model {health['model']}, {health['n_slots']} slots x {health['n_ctx']} ctx, "
          f"{args.threads} threads, n_batch 512, flash attention off, greedy, prompt "
          f"~{args.prompt_tokens} tokens + nonce, {args.tokens} generated, {args.runs} runs alternating raw/served, "
          f"host {os.cpu_count()} CPUs")
    print(f"{'row':38s} {'min':>7s} {'median':>7s} {'max':>7s}  (tok/s)")
    print(f"{'1 stream  raw llama.cpp in-process':38s} {summary(one_raw)}")
    print(f"{'1 stream  served, client-measured':38s} {summary(one_srv)}")
    print(f"{'1 stream  served, engine-measured':38s} {summary(one_eng)}")
    print(f"{'4 streams raw aggregate':38s} {summary(four_raw)}")
    print(f"{'4 streams served aggregate':38s} {summary(four_srv)}")
    print(f"{'4 streams served per stream, 1st-last':38s} {summary(four_per)}")
    print(f"greedy text identical to raw llama.cpp: {same_text} of {5 * args.runs} streams")
    ratio = [s / r for s, r in zip(one_srv, one_raw)]
    print(f"\nserved / raw, one stream (pairwise): {summary(ratio).replace('.', '.', 1)}  "
          f"median {statistics.median(ratio):.3f}")
    print(f"served 4-stream aggregate / served 1 stream: {statistics.median(four_srv) / statistics.median(one_srv):.2f}x; "
          f"raw: {statistics.median(four_raw) / statistics.median(one_raw):.2f}x")
    if rss:
        print(f"peak RSS after a {rss['depth']}-token context: server {rss['server'] / 2**20:.0f} MiB, "
              f"engine {rss['engine'] / 2**20:.0f} MiB (KV pool {health['kv_bytes'] / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
