#!/usr/bin/env python3
"""The checks of issue 45 on a llama.cpp Vulkan device, each row a figure with its conditions.

Run by scripts/vulkan_check.sh in the venv it builds (llama-cpp-python with -DGGML_VULKAN=on) with
GGML_VK_VISIBLE_DEVICES=0, so llama.cpp lists a CPU-type device (Mesa's lavapipe) as Vulkan0. The
"CPU build" it compares with is the same build with that variable set empty: llama.cpp then has no
Vulkan device and computes on its CPU backend alone, the same code as a CPU build's.

    python scripts/vulkan_checks.py --out DIR [--only hostcheck,serve,...] [--per-set N]

Each check starts `appliance serve` (or `hostcheck`, `fit`, `sweep`) as a child process and reads
what it reports: /health's placement (planned bytes beside the buffers llama.cpp said it
allocated), its settings (what the start-up probes decided), replies with logprobs. It writes
DIR/vulkan-checks.json and prints the table (markdown). Exit status 1 if a check failed to run.

This file holds the checks of issue 45, CHECKS and main(); scripts/vulkan_harness.py the harness
they share (Row, Server, the --model target, placement rows, the table), and
scripts/vulkan_device_checks.py issue 72's checks (the device's logits against the CPU backend's,
fixed-shape decode), which CHECKS lists with the others.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import served_outputs as so     # scripts/: the prompt sets' requests, a server's start and stop
from vulkan_device_checks import check_device, check_fixed_shape
from vulkan_harness import (HIDDEN, MIB, PY, QUICK, TARGET, Row, Server, chat, env_with, serve_check,
                            table)


# -- the checks ----------------------------------------------------------------------------------------

def check_hostcheck(out: Path, ctx: dict) -> list[Row]:
    run = subprocess.run([*PY, "hostcheck", "--json"], capture_output=True, text=True, timeout=300)
    doc = json.loads(run.stdout)
    (out / "hostcheck.json").write_text(run.stdout)
    said = [ln.split(" = ", 1)[1] for ln in run.stderr.splitlines() if ln.startswith("ggml_vulkan: 0 = ")]
    rows = [Row("device", f"{driver_info()}; llama.cpp says: {said[0] if said else '(no ggml_vulkan line)'}",
                f"vulkaninfo --summary; {os.cpu_count()} cores", "ok")]
    for d in (doc.get("llama_cpp") or {}).get("devices", []):
        rows.append(Row("hostcheck", f"llama.cpp device {d['name']} ({d['description']}): {d['total_bytes'] / 2**30:.2f} "
                                     f"GiB, {d['free_bytes'] / 2**30:.2f} free, kind {d['kind']}, host memory "
                                     f"{d['host_memory']}", "appliance hostcheck --json", "ok"))
    for v in doc["snapshot"]["gpu"].get("vulkan") or []:
        rows.append(Row("hostcheck", f"Vulkan loader: {v['name']}, type {v['type']}, API {v['api_version']}, "
                                     f"device-local heaps {v['device_local_bytes'] / 2**30:.2f} GiB",
                        "appliance hostcheck --json", "ok"))
    if not any(d["name"].startswith("Vulkan") for d in (doc.get("llama_cpp") or {}).get("devices", [])):
        rows.append(Row("hostcheck", "no Vulkan device listed by llama.cpp", "", "FAIL"))
    return rows


def driver_info() -> str:
    """The Vulkan driver and its version (lavapipe's is Mesa's), as vulkaninfo says it."""
    run = subprocess.run("vulkaninfo --summary", shell=True, capture_output=True, text=True, timeout=60)
    got = [ln.split("=", 1)[1].strip() for ln in run.stdout.splitlines() if ln.strip().startswith("driverInfo")]
    return f"driver {got[0]}" if got else "vulkaninfo lists no driverInfo"


def check_fit(out: Path, ctx: dict) -> list[Row]:
    rows = []
    for args in (["--n-ctx", "8192", "--n-slots", "4"], ["--n-ctx", "8192", "--n-slots", "16"]):
        run = subprocess.run([*PY, "fit", "--json", *TARGET.args, *args], capture_output=True, text=True, timeout=300)
        p = json.loads(run.stdout)
        gpu = p["devices"].get("GPU0")
        figure = (f"exit {run.returncode}; n_gpu_layers {p['n_gpu_layers']}, n_cpu_ffn {p['n_cpu_ffn']}; GPU0 "
                  f"{gpu['total'] / 2**30:.2f} of {gpu['budget'] / 2**30:.2f} GiB" if gpu else "no GPU0 planned")
        rows.append(Row("fit", figure, f"appliance fit ({TARGET.name}) " + " ".join(args),
                        "ok" if gpu and run.returncode == 0 else "FAIL"))
    return rows


def check_serve(out: Path, ctx: dict) -> list[Row]:
    rows, base = [], [*QUICK, "--n-ctx", "512"]
    for ngl in ("all", "auto", "15"):
        rows += serve_check(out, f"serve -ngl {ngl}", [*base, "--n-gpu-layers", ngl],
                            f"{TARGET.name}, --n-gpu-layers {ngl}, 1 x 512 positions, f16 KV")
    for kv in ("q8_0", "q4_0"):
        rows += serve_check(out, f"serve --kv-type {kv}", [*base, "--n-gpu-layers", "all", "--kv-type", kv],
                            f"{TARGET.name}, all layers on Vulkan0, --kv-type {kv} (flash attention on)")
    return rows


def check_moe(out: Path, ctx: dict) -> list[Row]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.engine.gguf_fixtures import write_tiny

    path = write_tiny(out / "tiny-qwen3moe.gguf", "qwen3moe", n_layer=3, n_expert=4, n_expert_used=2)
    base = [*QUICK, "--model", str(path), "--n-ctx", "512"]
    rows = []
    for name, args in (("--cpu-moe", ["--n-gpu-layers", "all", "--cpu-moe"]),
                       ("--n-cpu-moe 1", ["--n-gpu-layers", "all", "--n-cpu-moe", "1"]),
                       ("-ot to Vulkan0", ["--n-gpu-layers", "0", "--override-tensor",
                                           r"blk\.[12]\.ffn_(up|down|gate)_exps=Vulkan0"])):
        rows += serve_check(out, f"moe {name}", base + args,
                            f"tiny qwen3moe (3 layers, 4 experts, top 2, F32), {' '.join(args)}")
    return rows


# -- greedy replies: the device against the CPU build ------------------------------------------------

def record(url: str, prompts: list, max_tokens: int) -> dict[str, dict]:
    """Each prompt's cold reply, then the same again (a prompt-cache hit), with logprobs."""
    got = {}
    for set_name, prompt in prompts:
        body = so.request_body(prompt, max_tokens, stream=False)
        got[f"{set_name}/{prompt.id}"] = {"cold": so.post_plain(url, body, 3600), "warm": so.post_plain(url, body, 3600)}
    return got


def agreement(dev: dict, cpu: dict) -> dict:
    """Replies identical, the share of tokens before the first difference, and for each of those
    tokens (same token, same context) |logprob on the device - logprob on the CPU|."""
    same = agree = total = 0
    diffs = []
    for key, d in dev.items():
        a, b = d["cold"], cpu[key]["cold"]
        n = so.first_difference(a["tokens"], b["tokens"])
        same += a["tokens"] == b["tokens"]
        agree, total = agree + n, total + max(len(a["tokens"]), len(b["tokens"]))
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n]) if x is not None and y is not None]
    diffs.sort()
    q = (lambda f: diffs[min(int(f * len(diffs)), len(diffs) - 1)]) if diffs else (lambda f: float("nan"))
    return {"replies": len(dev), "identical": same, "tokens_agreeing": agree, "tokens": total,
            "logprob_diff_median": statistics.median(diffs) if diffs else float("nan"),
            "logprob_diff_p90": q(0.9), "logprob_diff_max": diffs[-1] if diffs else float("nan")}


def probe_rows(health: dict, who: str, conditions: str) -> list[Row]:
    s = health["settings"]
    spec, reuse = s.get("speculation") or {}, s.get("prompt_cache_reuse") or {}
    return [Row(f"probe: verify exactness ({who})",
                f"exact {spec.get('exact')}, max |logit diff| {spec.get('exact_max_abs_diff')} -> speculation "
                f"{spec.get('default')}: {spec.get('reason')}", conditions, "ok"),
            Row(f"probe: chunk invariance ({who})",
                f"prompt cache reuses {reuse.get('exact_reuse')} (min_chunk {reuse.get('min_chunk')}, "
                f"{reuse.get('cases')} cuts; failed: {'; '.join(reuse.get('failed') or []) or 'none'})", conditions,
                "ok")]


def check_agreement(out: Path, ctx: dict) -> list[Row]:
    sets = ["prose", "code", "repetitive", "multilingual", "editing-code", "tool-calls"]
    per = {s: ctx["per_set"] for s in sets} | {"editing-code": 1, "tool-calls": 1}
    prompts = so.choose_prompts(sets, per)
    args = ["--plan", "off", "--n-ctx", "2048", "--n-slots", "1", "--prefill-chunk", "64"]
    cond = (f"{TARGET.name}, {len(prompts)} prompts ({', '.join(sets)}), greedy, {ctx['max_tokens']} tokens, "
            "1 x 2048 positions, --prefill-chunk 64, speculation auto, prompt cache on")
    rows, replies = [], {}
    for who, extra, env in (("Vulkan0", ["--n-gpu-layers", "all"], None), ("CPU build", [], HIDDEN)):
        srv = Server(out, f"agreement-{who.split()[0]}", args + extra, env)
        try:
            t0 = time.monotonic()
            health = srv.wait(3600)
            if health is None:
                return rows + [Row(f"agreement ({who})", f"did not start: {srv.tail(600)}", cond, "FAIL")]
            rows += probe_rows(health, who, cond + f"; started in {time.monotonic() - t0:.0f} s")
            replies[who] = record(srv.url, prompts, ctx["max_tokens"])
        finally:
            srv.stop()
        warm = sum(r["cold"]["tokens"] == r["warm"]["tokens"] for r in replies[who].values())
        rows.append(Row(f"prompt cache hit = cold reply ({who})", f"{warm} of {len(prompts)} warm replies identical "
                        "to their cold reply", cond, "ok" if warm == len(prompts) else "FINDING"))
    (out / "agreement.json").write_text(json.dumps(replies, indent=1))
    a = agreement(replies["Vulkan0"], replies["CPU build"])
    rows.append(Row("greedy replies, Vulkan0 vs CPU build",
                    f"{a['identical']} of {a['replies']} replies identical; {a['tokens_agreeing']} of {a['tokens']} "
                    f"tokens ({100 * a['tokens_agreeing'] / max(a['tokens'], 1):.0f}%) before the first difference; "
                    f"same token's logprob differs by {a['logprob_diff_median']:.3g} nats median, p90 "
                    f"{a['logprob_diff_p90']:.3g}, max {a['logprob_diff_max']:.3g}", cond, "ok"))
    return rows


# -- a device that runs out of memory ------------------------------------------------------------------

def check_oom(out: Path, ctx: dict) -> list[Row]:
    srv = Server(out, "oom-planner", [*QUICK, "--n-gpu-layers", "all", "--n-ctx", "8192", "--n-slots", "12"])
    try:
        srv.proc.wait(timeout=600)
    finally:
        srv.stop()
    said = [ln for ln in srv.tail(6000).splitlines() if "does not fit" in ln or "needs" in ln]
    rows = [Row("too big for the device: refused at start", f"serve exit {srv.proc.returncode}: {' / '.join(said)[:400]}",
                f"{TARGET.name}, --n-gpu-layers all, 12 x 8192 positions (KV 2.1 GiB, the device 2 GiB)",
                "ok" if srv.proc.returncode == 1 and said else "FAIL")]
    return rows + failing_load(out)


def failing_load(out: Path) -> list[Row]:
    """Loads where the device gives less than the planner counted on, forced by ggml-vulkan's
    GGML_VK_FORCE_MAX_BUFFER_SIZE: llama.cpp moves weights to host memory by itself (the
    placement notes it), or fails on a KV buffer (that model's requests get a clear error, the
    server serves on)."""
    from appliance.library.index import Library
    from appliance.models import EMBEDDED_ALIAS, embedded_model_path

    root = Path(tempfile.mkdtemp(prefix="vk-library-"))
    (root / "local").mkdir()
    common = 'speculate = "off"\nprompt_cache = "off"\nn_gpu_layers = "all"\n'
    settings = f'["{EMBEDDED_ALIAS}"]\nn_ctx = 512\nn_slots = 1\nspeculate = "off"\nprompt_cache = "off"\n' \
               'n_gpu_layers = "0"\nn_ubatch = 64\n'
    for name, n_ctx, n_slots in (("smol-fallback", 512, 1), ("smol-fails", 4096, 2)):
        copy = root / "local" / f"{name}.gguf"
        copy.symlink_to(embedded_model_path())
        Library(root).add(name, [copy], "hf:local/smol", {"repo": "local/smol"})
        settings += f'["{name}"]\nn_ctx = {n_ctx}\nn_slots = {n_slots}\n{common}'
    (root / "settings.toml").write_text(settings)
    cond = ("--library: the embedded model on the CPU (compute on Vulkan0, 44 MiB), and copies of it with every "
            "layer on Vulkan0 (92 MiB of weights): smol-fallback 1 x 512 positions (KV 11 MiB), smol-fails 2 x 4096 "
            "(KV 180 MiB); GGML_VK_FORCE_MAX_BUFFER_SIZE=64 MiB")
    srv = Server(out, "oom-llama", ["--plan", "off", "--library", str(root)],
                 {"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(64 * MIB)})
    try:
        if srv.wait() is None:
            return [Row("fails inside llama.cpp", f"the server did not start: {srv.tail(600)}", cond, "FAIL")]
        moved = chat(srv.url, "Hi", model="smol-fallback")
        log_notes = [ln.split("placement: ", 1)[1] for ln in srv.tail(20000).splitlines() if "WARNING placement: " in ln]
        bad, good = chat(srv.url, "Hi", model="smol-fails"), chat(srv.url, "Hi", model=EMBEDDED_ALIAS)
        err = bad.json().get("error", {}) if bad.headers.get("content-type", "").startswith("application/json") else {}
        return [Row("llama.cpp moves weights off the device by itself: noted",
                    f"smol-fallback: HTTP {moved.status_code}; warned: {'; '.join(log_notes) or 'nothing'}",
                    cond, "ok" if moved.ok and log_notes else "FAIL"),
                Row("fails inside llama.cpp: a clear error, the server serves on",
                    f"smol-fails: HTTP {bad.status_code} {err.get('code')}: ...{str(err.get('message'))[-260:]}; "
                    f"then the default model: HTTP {good.status_code}", cond,
                    "ok" if bad.status_code == 500 and err.get("code") == "model_load_failed" and good.ok else "FAIL")]
    finally:
        srv.stop()


def check_sweep(out: Path, ctx: dict) -> list[Row]:
    db = out / "bench.db"
    args = ["sweep", "-p", "64,256", "-n", "16", "--runs", "1", "--no-raw", "--quiet", "--db-path", str(db),
            "--plan", "off", "--speculate", "off", "--prompt-cache", "off", "--n-ctx", "1024", "--n-slots", "1"]
    rows = []
    for who, extra, env in (("Vulkan0", ["--n-gpu-layers", "all"], None), ("CPU build", [], HIDDEN)):
        load = os.getloadavg()[0]
        run = subprocess.run([*PY, *args, *TARGET.args, *extra], capture_output=True, text=True, timeout=3600, env=env_with(env or {}))
        (out / f"sweep-{who.split()[0]}.txt").write_text(run.stdout + run.stderr)
        cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in run.stdout.splitlines()
                 if ln.strip().startswith("| sweep p=")]
        said = [f"p={c[6]}: time to first token {c[10]} ms, prefill {c[12]} tok/s, decode {c[14]} tok/s (engine)"
                for c in cells if len(c) > 14]
        rows.append(Row(f"bench sweep ({who})", "; ".join(said) or run.stderr[-300:],
                        "appliance " + " ".join(args[:8] + extra) + f" (columns as `appliance results`); load "
                        f"average {load:.1f} on {os.cpu_count()} cores at its start; speed is not a goal here",
                        "ok" if run.returncode == 0 else "FAIL"))
    return rows


CHECKS = {"hostcheck": check_hostcheck, "fit": check_fit, "serve": check_serve, "moe": check_moe,
          "oom": check_oom, "agreement": check_agreement, "sweep": check_sweep,
          "device": check_device, "fixed-shape": check_fixed_shape}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("test-artifacts/vulkan"))
    ap.add_argument("--only", help=f"checks to run, comma-separated (default all: {','.join(CHECKS)})")
    # shrunk for lavapipe (about 10 tokens/s prefill, 2 decode): 10 prompts of 32 tokens take 23 minutes
    ap.add_argument("--per-set", type=int, default=2, help="prompts per short prompt set in the agreement check")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per greedy reply in the agreement check")
    ap.add_argument("--model", type=Path, help="a GGUF every check uses instead of the embedded model")
    args = ap.parse_args(argv)
    if args.model:
        TARGET.args, TARGET.name = ["--model", str(args.model)], args.model.name
    args.out.mkdir(parents=True, exist_ok=True)
    ctx, rows = {"per_set": args.per_set, "max_tokens": args.max_tokens}, []
    for name in (args.only.split(",") if args.only else CHECKS):
        t0 = time.monotonic()
        try:
            got = CHECKS[name](args.out, ctx)
        except Exception as e:          # one check's crash is its row; the others still run
            got = [Row(name, f"the check itself failed: {type(e).__name__}: {e}", "", "FAIL")]
        rows += got
        print(f"{name}: {len(got)} rows in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        (args.out / "vulkan-checks.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(table(rows))
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
