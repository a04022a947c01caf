#!/usr/bin/env python3
"""Record the served greedy replies to the shipped prompt sets, and compare two recordings token for token.

Issue 15 asks that served output stay token for token what it was across a refactor: greedy replies
to the shipped prompt sets, with the prompt cache on, from the commit before the change and from
after it. This script records one side at a time and compares two recordings.

    # the commit before (a worktree of it), then the code as it is now
    PYTHONPATH=/tmp/before python scripts/served_outputs.py record --out /tmp/outputs-before.json
    python scripts/served_outputs.py record --out /tmp/outputs-after.json
    python scripts/served_outputs.py compare /tmp/outputs-before.json /tmp/outputs-after.json

`record` starts `python -m appliance serve --port P --plan off --cache-dir <fresh temp dir>
--engine E` as a child process that inherits this environment, so PYTHONPATH chooses which copy
of the code serves (run it from a directory that holds no other `appliance` package, e.g. /tmp).
It waits for GET /health to answer 200, then for every chosen prompt of every chosen set sends, in
this order, to /v1/chat/completions with `temperature: 0`, `logprobs: true` and the prompt's tools:

    cold    a non-streamed request (the first time the server sees this prompt)
    warm    the same request again: a prompt-cache hit (the prompt cache is on by default)
    stream  the same request streamed (SSE, with `stream_options.include_usage`): the SSE path

and keeps, per reply, the tokens (each logprobs entry's `bytes`), content, tool calls,
reasoning_content, finish_reason, usage (prompt, completion and cached tokens) and timings.cache_n,
with the /health `settings` for reference. The server is stopped with SIGTERM.

`compare A B` compares each reply's token bytes, content, reasoning, tool calls (name and
arguments: call ids are random), finish reason, token counts and cached-token counts, prints one
line per reply and "N of M replies identical", and exits 1 if anything differs or is missing.
Differences in the /health settings are printed as notes only (a refactor may add settings).

Only `appliance.bench.prompt_sets` is imported from the project, so the script runs against the
old copy and the new one alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import requests

from appliance.bench import prompt_sets

# Prompts kept per set by default, so a recording takes ~5 minutes on a 2-core CPU (SmolLM2-135M).
# Rough prompt sizes: the short sets ~100-400 tokens each, editing-code ~1,000, tool-calls
# ~1,500-2,000, long-document ~5,000 (prefill ~200-300 tok/s on this CPU). None = every prompt.
DEFAULT_PER_SET: dict[str, int | None] = {"editing-code": 2, "tool-calls": 2, "long-document": 1}
KINDS = ("cold", "warm", "stream")


# -- record -------------------------------------------------------------------------------------

def parse_per_set(text: str | None) -> dict[str, int | None]:
    """'N' (every set), 'all', or 'name=N,name=all,...' on top of the defaults."""
    limits = dict(DEFAULT_PER_SET)
    if not text:
        return limits
    text = text.strip()
    if "=" not in text:
        n = None if text == "all" else int(text)
        return {name: n for name in prompt_sets.names()}
    for part in text.split(","):
        name, _, value = part.partition("=")
        limits[name.strip()] = None if value.strip() == "all" else int(value)
    return limits


def choose_prompts(sets: list[str], per_set: dict[str, int | None]) -> list[tuple[str, prompt_sets.Prompt]]:
    chosen = []
    for name in sets:
        prompts = prompt_sets.load(name).prompts
        limit = per_set.get(name)
        chosen += [(name, p) for p in (prompts if limit is None else prompts[:limit])]
    return chosen


def start_server(args: argparse.Namespace, cache_dir: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "appliance", "serve", "--port", str(args.port), "--plan", "off",
           "--cache-dir", cache_dir, "--engine", args.engine, *args.serve_arg]
    print("starting:", " ".join(cmd), f"(PYTHONPATH={os.environ.get('PYTHONPATH', '')!r})", flush=True)
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            r = requests.get(f"{base}/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except requests.RequestException:
            pass
        time.sleep(1)
    with open(log_path, "rb") as f:
        tail = f.read()[-4000:].decode(errors="replace")
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not healthy after {timeout_s:.0f} s"
    raise SystemExit(f"served_outputs: the server {state}; the end of its output:\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_body(prompt: prompt_sets.Prompt, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": list(prompt.messages), "temperature": 0, "max_tokens": max_tokens,
                            "logprobs": True, "stream": stream}
    if prompt.tools:
        body["tools"] = list(prompt.tools)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def reply_record(content: str | None, reasoning: str | None, tool_calls: list[dict], finish: str | None,
                 logprobs: list[dict], usage: dict | None, timings: dict | None, wall_s: float) -> dict[str, Any]:
    usage = usage or {}
    timings = timings or {}
    return {
        "tokens": [list(e.get("bytes") or []) for e in logprobs],
        "text_tokens": [e.get("token") for e in logprobs],
        "logprobs": [e.get("logprob") for e in logprobs],  # kept for reference (compare reads tokens)
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments"),
                        "id": c.get("id")} for c in tool_calls],
        "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "cache_n": timings.get("cache_n"),
        "prompt_n": timings.get("prompt_n"),
        "timings": timings,  # all of them, for reference (compare ignores them: they are measured)
        "wall_s": round(wall_s, 3),
    }


def post_plain(base: str, body: dict, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    r = requests.post(f"{base}/v1/chat/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise SystemExit(f"served_outputs: HTTP {r.status_code}: {r.text[:2000]}")
    data = r.json()
    choice = data["choices"][0]
    msg = choice.get("message") or {}
    return reply_record(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls") or [],
                        choice.get("finish_reason"), ((choice.get("logprobs") or {}).get("content") or []),
                        data.get("usage"), data.get("timings"), time.monotonic() - t0)


def post_stream(base: str, body: dict, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict] = {}
    logprobs: list[dict] = []
    finish = usage = timings = None
    saw_content = False
    with requests.post(f"{base}/v1/chat/completions", json=body, timeout=timeout_s, stream=True) as r:
        if r.status_code != 200:
            raise SystemExit(f"served_outputs: HTTP {r.status_code}: {r.text[:2000]}")
        for raw in r.iter_lines():
            line = raw.decode("utf-8")
            if not line.startswith("data: "):
                continue  # blank separators and `: keep-alive` comments
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise SystemExit(f"served_outputs: error in stream: {payload[:2000]}")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") is not None:
                    content.append(delta["content"])
                    saw_content = saw_content or bool(delta["content"])
                if delta.get("reasoning_content"):
                    reasoning.append(delta["reasoning_content"])
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc["index"], {"id": None, "function": {"name": None, "arguments": ""}})
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["function"]["name"] = fn.get("name") or call["function"]["name"]
                    call["function"]["arguments"] += fn.get("arguments") or ""
                logprobs += (choice.get("logprobs") or {}).get("content") or []
                finish = choice.get("finish_reason") or finish
    text = "".join(content)
    if calls and not text:
        text = None  # as the non-streamed message gives it: content null beside tool calls
    return reply_record(text, "".join(reasoning) or None, [calls[i] for i in sorted(calls)], finish, logprobs,
                        usage, timings, time.monotonic() - t0)


def code_origin() -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(prompt_sets.__file__))))
    origin: dict[str, Any] = {"root": root, "pythonpath": os.environ.get("PYTHONPATH")}
    try:
        origin["commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                          text=True, timeout=10).stdout.strip() or None
        origin["dirty"] = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                              capture_output=True, text=True, timeout=30).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return origin


def record(args: argparse.Namespace) -> int:
    sets = args.sets.split(",") if args.sets else list(prompt_sets.DEFAULT_SETS)
    chosen = choose_prompts(sets, parse_per_set(args.per_set))
    base = f"http://127.0.0.1:{args.port}"
    tmp = tempfile.mkdtemp(prefix="served-outputs-")
    log_path = os.path.join(tmp, "server.log")
    started = time.monotonic()
    proc = start_server(args, os.path.join(tmp, "prompt-cache"), log_path)
    replies: dict[str, dict] = {}
    try:
        health = wait_healthy(base, proc, log_path, args.start_timeout)
        print(f"healthy after {time.monotonic() - started:.0f} s: {health.get('model')} on {health.get('backend')}, "
              f"{len(chosen)} prompts x {len(KINDS)} replies", flush=True)
        for set_name, prompt in chosen:
            for kind in KINDS:
                body = request_body(prompt, args.max_tokens, stream=kind == "stream")
                rec = (post_stream if kind == "stream" else post_plain)(base, body, args.request_timeout)
                key = f"{set_name}/{prompt.id}/{kind}"
                replies[key] = {"set": set_name, "prompt": prompt.id, "kind": kind, **rec}
                print(f"  {key}: {len(rec['tokens'])} tokens, {rec['finish_reason']}, cached {rec['cached_tokens']}"
                      f" of {rec['prompt_tokens']}, {rec['wall_s']:.1f} s", flush=True)
    finally:
        stop_server(proc)
        if args.keep_log:
            print(f"server log kept at {log_path}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    out = {
        "format": "served_outputs/1",
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(elapsed, 1),
        "code": code_origin(),
        "options": {"max_tokens": args.max_tokens, "sets": sets, "per_set": parse_per_set(args.per_set),
                    "engine": args.engine, "serve_args": args.serve_arg},
        "server": {k: health.get(k) for k in ("model", "model_fingerprint", "backend", "n_ctx", "n_slots", "kv_bytes")},
        "settings": health.get("settings"),
        "replies": replies,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    print(f"wrote {len(replies)} replies to {args.out} in {elapsed:.0f} s")
    for note in self_consistency(replies):
        print("note:", note)
    return 0


def self_consistency(replies: dict[str, dict]) -> list[str]:
    """Within one recording: the warm and streamed replies should be the cold one, token for token."""
    notes = []
    for key, rec in replies.items():
        if rec["kind"] == "cold":
            continue
        cold = replies.get(f"{rec['set']}/{rec['prompt']}/cold")
        if cold is None:
            continue
        if cold["tokens"] != rec["tokens"]:
            pos = first_difference(cold["tokens"], rec["tokens"])
            notes.append(f"{key}: tokens differ from its cold reply's at {pos} "
                         f"({len(cold['tokens'])} vs {len(rec['tokens'])} tokens)")
        if calls_key(cold["tool_calls"]) != calls_key(rec["tool_calls"]) or cold["content"] != rec["content"]:
            notes.append(f"{key}: content or tool calls differ from its cold reply's")
    return notes


# -- compare ------------------------------------------------------------------------------------

def first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def calls_key(calls: list[dict] | None) -> list[tuple]:
    return [(c.get("name"), c.get("arguments")) for c in calls or []]  # ids are random per reply


FIELDS = ("content", "reasoning_content", "finish_reason", "prompt_tokens", "completion_tokens",
          "cached_tokens", "cache_n")


def differences(a: dict, b: dict) -> list[str]:
    found = []
    if a["tokens"] != b["tokens"]:
        pos = first_difference(a["tokens"], b["tokens"])
        at = lambda r: bytes(r["tokens"][pos]) if pos < len(r["tokens"]) else "end"  # noqa: E731
        found.append(f"tokens at {pos} ({len(a['tokens'])} vs {len(b['tokens'])} tokens; {at(a)!r} vs {at(b)!r})")
    if calls_key(a.get("tool_calls")) != calls_key(b.get("tool_calls")):
        found.append(f"tool_calls {calls_key(a.get('tool_calls'))!r} vs {calls_key(b.get('tool_calls'))!r}")
    for field in FIELDS:
        if a.get(field) != b.get(field):
            va, vb = a.get(field), b.get(field)
            if isinstance(va, str) and isinstance(vb, str):
                pos = first_difference(list(va), list(vb))
                found.append(f"{field} at char {pos}")
            else:
                found.append(f"{field} {va!r} vs {vb!r}")
    return found


def compare(args: argparse.Namespace) -> int:
    with open(args.a, encoding="utf-8") as f:
        a = json.load(f)
    with open(args.b, encoding="utf-8") as f:
        b = json.load(f)
    print(f"A: {args.a} ({a.get('code', {}).get('root')} @ {a.get('code', {}).get('commit')})")
    print(f"B: {args.b} ({b.get('code', {}).get('root')} @ {b.get('code', {}).get('commit')})")
    if a.get("server", {}).get("model_fingerprint") != b.get("server", {}).get("model_fingerprint"):
        print(f"note: different models: {a.get('server')} vs {b.get('server')}")
    if a.get("options", {}).get("max_tokens") != b.get("options", {}).get("max_tokens"):
        print(f"note: max_tokens {a['options'].get('max_tokens')} vs {b['options'].get('max_tokens')}")
    sa, sb = a.get("settings") or {}, b.get("settings") or {}
    for k in sorted(set(sa) | set(sb)):
        if sa.get(k, "<absent>") != sb.get(k, "<absent>"):
            print(f"note: setting {k}: {sa.get(k, '<absent>')!r} vs {sb.get(k, '<absent>')!r}")
    ra, rb = a["replies"], b["replies"]
    keys = list(ra) + [k for k in rb if k not in ra]
    same = 0
    for key in keys:
        if key not in ra or key not in rb:
            print(f"{key}: DIFFERS (missing from {'A' if key not in ra else 'B'})")
            continue
        found = differences(ra[key], rb[key])
        if found:
            print(f"{key}: DIFFERS: {'; '.join(found)}")
        else:
            same += 1
            print(f"{key}: same ({len(ra[key]['tokens'])} tokens, cached {ra[key].get('cached_tokens')})")
    print(f"{same} of {len(keys)} replies identical")
    return 0 if same == len(keys) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="serve the code on PYTHONPATH and record its greedy replies")
    rec.add_argument("--out", required=True, metavar="FILE.json")
    rec.add_argument("--max-tokens", type=int, default=48)
    rec.add_argument("--sets", metavar="A,B,...", help=f"prompt sets (default: {','.join(prompt_sets.DEFAULT_SETS)})")
    rec.add_argument("--per-set", metavar="SPEC",
                     help="prompts kept per set: N or 'all' for every set, or name=N,... over the defaults "
                          f"({', '.join(f'{k}={v}' for k, v in DEFAULT_PER_SET.items())}; the others: all)")
    rec.add_argument("--port", type=int, default=18431)
    rec.add_argument("--engine", choices=("llamacpp", "torch"), default="llamacpp")
    rec.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                     help="one more argument for `appliance serve` (repeat it; e.g. --serve-arg=--n-slots=2)")
    rec.add_argument("--start-timeout", type=float, default=300, help="seconds to wait for /health (default 300)")
    rec.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default 600)")
    rec.add_argument("--keep-log", action="store_true", help="keep the server's output (printed path)")
    cmp_ = sub.add_parser("compare", help="compare two recordings token for token (exit 1 if they differ)")
    cmp_.add_argument("a", metavar="A.json")
    cmp_.add_argument("b", metavar="B.json")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
