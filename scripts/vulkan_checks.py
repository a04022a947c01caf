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
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

import served_outputs as so     # scripts/: the prompt sets' requests, a server's start and stop

MIB = 2**20
PY = [sys.executable, "-m", "appliance"]
QUICK = ["--plan", "off", "--speculate", "off", "--prompt-cache", "off", "--n-slots", "1"]
# the CPU build: an empty list of Vulkan devices (lavapipe is listed only when asked for; a
# discrete GPU is listed unless hidden so)
HIDDEN = {"GGML_VK_VISIBLE_DEVICES": ""}
# --model: every check serves, fits and sweeps this file instead of the embedded model (a machine
# without the embedded model's package: scripts/gpu_check.sh writes one with scripts/gpu_model.py)
MODEL: list[str] = []
MODEL_NAME = "embedded model"


@dataclass
class Row:
    check: str
    figure: str
    conditions: str
    verdict: str          # ok | FINDING | FAIL


def env_with(changes: dict[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in changes.items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    return env


class Server:
    """`appliance serve` in a child process, on its own port, log and cache directory."""

    port = 18600

    def __init__(self, out: Path, name: str, args: list[str], env: dict[str, str | None] | None = None):
        Server.port += 1
        self.url, self.log = f"http://127.0.0.1:{Server.port}", out / f"serve-{name}.log"
        cache = tempfile.mkdtemp(prefix="vk-cache-")
        model = [] if "--model" in args or "--library" in args else MODEL
        cmd = [*PY, "serve", "--port", str(Server.port), "--cache-dir", cache, "--engine-start-timeout", "3600",
               *model, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env=env_with(env or {}))
        self.cmd = " ".join(cmd[3:])

    def wait(self, timeout_s: float = 1800) -> dict | None:
        """/health once it answers 200; None when the server exited first."""
        try:
            return so.wait_healthy(self.url, self.proc, str(self.log), timeout_s)
        except SystemExit:
            return None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        so.stop_server(self.proc)


def chat(url: str, content: str, max_tokens: int = 8, **more) -> requests.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **more}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=1800)


# -- placement: planned against allocated ----------------------------------------------------------

def buffers(placement: dict) -> list[tuple[str, str, int, int]]:
    """(device, kind, planned, allocated) for the GPU and the host: llama.cpp's buffers by name
    (Vulkan0; CPU, CPU_Mapped, CPU_REPACK, Vulkan_Host for the host) against the planner's."""
    gpu = next((d["name"] for d in placement["llama_devices"] if d["kind"] in ("gpu", "igpu")), None)
    got, out = placement.get("allocated") or {}, []
    for dev, planner in ((gpu, placement.get("gpu")), ("host", "CPU")):
        use = placement["devices"].get(planner or "")
        if dev is None or use is None:
            continue
        names = [dev] if dev != "host" else [b for b in got if b != gpu]
        for kind, planned in (("model", sum(use["weights"].values())), ("KV", use["kv"]), ("compute", use["compute"])):
            have = sum(got.get(b, {}).get(kind, 0) for b in names)
            if planned or have:
                out.append((dev, kind, planned, have))
    return out


GOAL = {"model": 0.05, "KV": 0.05, "compute": 0.15}


def placement_rows(check: str, health: dict, conditions: str) -> list[Row]:
    p = health["placement"]
    rows = [Row(check, f"started; /health placement: n_gpu_layers {p['n_gpu_layers']}, overrides "
                       f"{p['overrides'] or 'none'}, notes {p['notes'] or 'none'}", conditions, "ok")]
    for dev, kind, planned, have in buffers(p):
        ratio = have / planned if planned else float("inf")
        mapped = dev == "host" and kind == "model" and "CPU_Mapped" in p.get("allocated", {})
        good = abs(ratio - 1) <= GOAL[kind] or (mapped and ratio >= 1)
        note = " (CPU_Mapped is the file's mapped span, not memory used)" if mapped and ratio > 1.05 else ""
        rows.append(Row(check, f"{dev} {kind}: planned {planned / MIB:.2f} MiB, llama.cpp {have / MIB:.2f} MiB, "
                               f"ratio {ratio:.3f}{note}", conditions, "ok" if good else "FINDING"))
    return rows


def serve_check(out: Path, check: str, args: list[str], conditions: str, env=None) -> list[Row]:
    srv = Server(out, check.replace(" ", "_").replace("/", ""), args, env)
    try:
        health = srv.wait()
        if health is None:
            return [Row(check, f"did not start: {srv.tail(600)}", conditions, "FAIL")]
        rows = placement_rows(check, health, conditions)
        t0 = time.monotonic()
        r = chat(srv.url, "Name a colour.")
        text = r.json()["choices"][0]["message"]["content"] if r.ok else r.text[:200]
        rows.append(Row(check, f"reply {r.status_code} in {time.monotonic() - t0:.1f} s: {text!r}", conditions,
                        "ok" if r.ok else "FAIL"))
        return rows
    finally:
        srv.stop()


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
        run = subprocess.run([*PY, "fit", "--json", *MODEL, *args], capture_output=True, text=True, timeout=300)
        p = json.loads(run.stdout)
        gpu = p["devices"].get("GPU0")
        figure = (f"exit {run.returncode}; n_gpu_layers {p['n_gpu_layers']}, n_cpu_ffn {p['n_cpu_ffn']}; GPU0 "
                  f"{gpu['total'] / 2**30:.2f} of {gpu['budget'] / 2**30:.2f} GiB" if gpu else "no GPU0 planned")
        rows.append(Row("fit", figure, f"appliance fit ({MODEL_NAME}) " + " ".join(args),
                        "ok" if gpu and run.returncode == 0 else "FAIL"))
    return rows


def check_serve(out: Path, ctx: dict) -> list[Row]:
    rows, base = [], [*QUICK, "--n-ctx", "512"]
    for ngl in ("all", "auto", "15"):
        rows += serve_check(out, f"serve -ngl {ngl}", [*base, "--n-gpu-layers", ngl],
                            f"{MODEL_NAME}, --n-gpu-layers {ngl}, 1 x 512 positions, f16 KV")
    for kv in ("q8_0", "q4_0"):
        rows += serve_check(out, f"serve --kv-type {kv}", [*base, "--n-gpu-layers", "all", "--kv-type", kv],
                            f"{MODEL_NAME}, all layers on Vulkan0, --kv-type {kv} (flash attention on)")
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
    cond = (f"{MODEL_NAME}, {len(prompts)} prompts ({', '.join(sets)}), greedy, {ctx['max_tokens']} tokens, "
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
                f"{MODEL_NAME}, --n-gpu-layers all, 12 x 8192 positions (KV 2.1 GiB, the device 2 GiB)",
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
        run = subprocess.run([*PY, *args, *MODEL, *extra], capture_output=True, text=True, timeout=3600, env=env_with(env or {}))
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


# -- the device check (issue 72): the device's logits against llama.cpp's CPU backend's ------------

def check_ids_row(name: str, doc: dict, conditions: str, want: str) -> Row:
    c = doc.get("comparison") or {}
    figure = (f"{doc.get('verdict')}: argmax agreement {c.get('argmax_agree', float('nan')):.1%} over "
              f"{c.get('positions')} positions, max |logit diff| {c.get('max_abs_diff', float('nan')):.3g}, KL mean "
              f"{c.get('kl_mean', float('nan')):.3g} max {c.get('kl_max', float('nan')):.3g} nats, perplexity "
              f"{c.get('ppl_device', float('nan')):.4g} device / {c.get('ppl_cpu', float('nan')):.4g} CPU; "
              f"{doc.get('device_s')} s device, {doc.get('cpu_s')} s CPU"
              + (f"; differed: {'; '.join(doc.get('differed') or [])}" if doc.get("differed") else "")
              if c else f"{doc.get('verdict')}: {doc.get('why')}")
    return Row(name, figure, conditions, "ok" if doc.get("verdict") == want else "FAIL")


def check_device(out: Path, ctx: dict) -> list[Row]:
    """`appliance check` on the model (fresh), a corrupted copy on the device against the original
    on the CPU (refused), and serve's start: measured once, remembered by a restart."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from appliance.models import embedded_model_path
    from tests.engine.gguf_fixtures import corrupt_copy

    data = {"XDG_DATA_HOME": tempfile.mkdtemp(prefix="vk-data-")}
    model = Path(MODEL[1]) if MODEL else embedded_model_path()
    from appliance.fit.gguf_header import read_header

    # the last layer's down projection: on the device with every layer there, near the output (#28211)
    downs = [t.name for t in read_header(model)[1] if t.name.endswith(".ffn_down.weight")]
    last = max(downs, key=lambda n: int(n.split(".")[1]))
    bad = corrupt_copy(model, out / "corrupt.gguf", last)
    rows = []
    for name, args, want in (("device check: appliance check", [str(model)], "agrees"),
                             ("device check: a corrupted tensor on the device", [str(bad), "--reference", str(model)],
                              "differs")):
        t0 = time.monotonic()
        run = subprocess.run([*PY, "check", *args, "--n-gpu-layers", "all", "--json"], capture_output=True,
                             text=True, timeout=1800, env=env_with(data))
        (out / f"check-{want}.txt").write_text(run.stdout + run.stderr)
        doc = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {"verdict": f"exit {run.returncode}",
                                                                                 "why": run.stderr[-300:]}
        rows.append(check_ids_row(name, doc, f"{MODEL_NAME} on Vulkan0 (all layers) against the CPU backend"
                                  + (f"; the device reads a copy with {last} corrupted" if want == "differs" else "")
                                  + f"; exit {run.returncode} in {time.monotonic() - t0:.0f} s", want))
    for attempt in ("first start", "restart"):
        srv = Server(out, f"devcheck-{attempt.replace(' ', '_')}", [*QUICK, "--n-ctx", "512", "--n-gpu-layers", "all"],
                     data)
        try:
            t0 = time.monotonic()
            health = srv.wait()
            took = time.monotonic() - t0
        finally:
            srv.stop()
        doc = (health or {}).get("settings", {}).get("device_check") or {"verdict": "did not start", "why": srv.tail(300)}
        row = check_ids_row(f"device check at serve's {attempt}", doc, f"{MODEL_NAME}, --n-gpu-layers all; started in "
                            f"{took:.0f} s; remembered: {doc.get('cached')}", "agrees")
        if attempt == "restart" and not doc.get("cached"):
            row.verdict = "FAIL"
        rows.append(row)
    return rows


def check_fixed_shape(out: Path, ctx: dict) -> list[Row]:
    """Issue 72: fixed-shape decode on Vulkan0 (scripts/fixed_shape_ab.py, in a child): what the
    policy chooses, the fixed shape's step against a plain one, lookup's identity and rate on the
    model, and the MTP fixture's identity with drafts priced free (its head's drafts accepted)."""
    rows = []
    for name, args, what in (("fixed-shape-ab", [*MODEL, "--tokens", "24"], f"{MODEL_NAME}, lookup"),
                             ("fixed-shape-mtp", ["--mtp-fixture", "--tokens", "40"], "the MTP fixture (random)")):
        report = out / f"{name}.json"
        run = subprocess.run([sys.executable, str(Path(__file__).with_name("fixed_shape_ab.py")), *args,
                              "--n-gpu-layers", "all", "--json", str(report)], capture_output=True, text=True,
                             timeout=3600)
        if not report.exists():
            rows.append(Row(f"fixed shape, {what}", run.stderr[-300:], "scripts/fixed_shape_ab.py", "FAIL"))
            continue
        r = json.loads(report.read_text())
        auto, f = r["auto"]["decode_shape"], r.get("forced", {})
        rates = ", ".join(f"{k} {v}" for k, v in f.items() if k.endswith("tok_s"))
        free = f.get("priced_free", {})
        rows.append(Row(f"fixed shape (issue 72), {what}", f"auto: {auto['mode']} ({auto['why']}); forced: identical "
                        f"{sum(f.get('identical', []))}/{len(f.get('identical', []))}; {rates}; drafted / accepted "
                        f"{f.get('drafted')} / {f.get('accepted')}, priced free {free.get('drafted')} / "
                        f"{free.get('accepted')}", f"all layers on Vulkan0, {r['rows']} rows, {r['tokens']} tokens a "
                        "request, one at a time", "ok" if run.returncode == 0 else "FINDING"))
    return rows


CHECKS = {"hostcheck": check_hostcheck, "fit": check_fit, "serve": check_serve, "moe": check_moe,
          "oom": check_oom, "agreement": check_agreement, "sweep": check_sweep,
          "device": check_device, "fixed-shape": check_fixed_shape}


def table(rows: list[Row]) -> str:
    lines = ["| check | figure | conditions | verdict |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.figure.replace('|', '/')} | {r.conditions.replace('|', '/')} | {r.verdict} |"
              for r in rows]
    return "\n".join(lines)


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
        global MODEL, MODEL_NAME
        MODEL, MODEL_NAME = ["--model", str(args.model)], args.model.name
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
