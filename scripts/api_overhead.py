#!/usr/bin/env python3
"""What each API's translation costs: decode rate and time to first token through every API
the server speaks, against /v1/chat/completions on the same prompt, side by side in one run.

Every API is a translator onto the one OpenAI chat request (issue 22 asks that it cost
nothing measurable: >= 0.98x). One server serves all of them; each prompt is sent through
every API in turn, greedy and streamed, the order rotated from one prompt and round to the
next, so a slow period of this shared machine falls on all of them alike. Per request, measured
at the client:

- TTFT: from sending the request to the first piece of reply text;
- decode rate: the reply's output tokens (each API's own usage count) less one, over the time
  from the first piece of text to the last.

It prints, per API, the median of the paired ratios API / chat completions (and their
quartiles) for both, and how many replies equal chat completions' text (greedy on the same
rendered prompt, they must all do). An API whose route answers 404 is left out, and said so.

    python scripts/api_overhead.py --rounds 3            # starts `appliance serve` itself
    python scripts/api_overhead.py --url http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import requests

from appliance.bench import prompt_sets
from appliance.bench.client import LocalServer

SETS = ("prose", "code", "multilingual")


@dataclass
class Reply:
    ttft: float
    rate: float
    text: str
    tokens: int


def _lines(url: str, body: dict[str, Any]) -> Iterator[tuple[float, bytes]]:
    with requests.post(url, json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line:
                yield time.perf_counter(), line


def _sse(url: str, body: dict[str, Any]) -> Iterator[tuple[float, dict[str, Any]]]:
    for t, line in _lines(url, body):
        if line.startswith(b"data: {"):
            yield t, json.loads(line[6:])


def openai_chat(base: str, model: str, messages: list, n: int) -> Iterator[tuple[float, str, int | None]]:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}}
    for t, c in _sse(base + "/v1/chat/completions", body):
        text = "".join((ch.get("delta") or {}).get("content") or "" for ch in c.get("choices") or [])
        yield t, text, (c.get("usage") or {}).get("completion_tokens")


def anthropic_messages(base: str, model: str, messages: list, n: int) -> Iterator[tuple[float, str, int | None]]:
    system = [m["content"] for m in messages if m["role"] == "system"]
    body = {"model": model, "max_tokens": n, "temperature": 0, "stream": True,
            "messages": [m for m in messages if m["role"] != "system"]}
    if system:
        body["system"] = "\n".join(system)
    for t, ev in _sse(base + "/v1/messages", body):
        text = (ev.get("delta") or {}).get("text") or "" if ev["type"] == "content_block_delta" else ""
        yield t, text, (ev.get("usage") or {}).get("output_tokens") if ev["type"] == "message_delta" else None


def openai_responses(base: str, model: str, messages: list, n: int) -> Iterator[tuple[float, str, int | None]]:
    body = {"model": model, "input": messages, "temperature": 0, "max_output_tokens": n, "stream": True}
    for t, ev in _sse(base + "/v1/responses", body):
        text = ev.get("delta") or "" if ev.get("type") == "response.output_text.delta" else ""
        done = ev.get("type") in ("response.completed", "response.incomplete")
        yield t, text, ((ev.get("response") or {}).get("usage") or {}).get("output_tokens") if done else None


def ollama_chat(base: str, model: str, messages: list, n: int) -> Iterator[tuple[float, str, int | None]]:
    body = {"model": model, "messages": messages, "stream": True,
            "options": {"temperature": 0, "num_predict": n}}
    for t, line in _lines(base + "/api/chat", body):
        c = json.loads(line)
        yield t, (c.get("message") or {}).get("content") or "", c.get("eval_count") if c.get("done") else None


APIS: dict[str, Callable[[str, str, list, int], Iterator[tuple[float, str, int | None]]]] = {
    "chat.completions": openai_chat, "anthropic.messages": anthropic_messages,
    "openai.responses": openai_responses, "ollama.chat": ollama_chat}


def one(api: str, base: str, model: str, messages: list, n: int) -> Reply:
    t0 = time.perf_counter()
    arrivals, text, tokens = [], [], None
    for t, piece, count in APIS[api](base, model, messages, n):
        if piece:
            arrivals.append(t)
            text.append(piece)
        tokens = count if count is not None else tokens
    if not arrivals or tokens is None:
        raise SystemExit(f"api_overhead: {api} gave no text or no token count")
    span = arrivals[-1] - arrivals[0]
    return Reply(arrivals[0] - t0, (tokens - 1) / span if span > 0 else float("nan"), "".join(text), tokens)


def served(base: str, model: str, api: str, messages: list) -> bool:
    try:
        one(api, base, model, messages, 2)
        return True
    except requests.HTTPError as e:
        if e.response is not None and e.response.status_code == 404:
            return False
        raise


def paired(label: str, ratios: list[float]) -> str:
    ratios = sorted(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{label} {q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `appliance serve` on the embedded model)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (default 3)")
    ap.add_argument("--tokens", type=int, default=96, help="max tokens per reply (default 96)")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per set (default 2)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"prompt sets (default {','.join(SETS)})")
    # no prompt cache: every request prefills its whole prompt, so each TTFT is a cold one (with
    # the cache, whichever API came first in a round would pay the prefill the others skip)
    ap.add_argument("--serve-args", default="--plan off --speculate off --no-prompt-cache --n-slots 1",
                    help="flags for the server it starts (default: %(default)s)")
    args = ap.parse_args(argv)
    prompts = [list(p.messages) for s in args.sets.split(",") for p in prompt_sets.load(s).prompts[:args.per_set]]
    server = None if args.url else LocalServer(args.serve_args.split())
    base = args.url or server.url
    try:
        model = requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        apis = [a for a in APIS if served(base, model, a, prompts[0])]
        left = [a for a in APIS if a not in apis]
        got: dict[str, list[Reply]] = {a: [] for a in apis}
        for rnd in range(args.rounds):
            for i, messages in enumerate(prompts):
                k = (rnd * len(prompts) + i) % len(apis)
                for api in apis[k:] + apis[:k]:
                    got[api].append(one(api, base, model, messages, args.tokens))
        health = requests.get(base + "/health", timeout=10).json()
    finally:
        if server is not None:
            server.stop()
    ref = got["chat.completions"]
    st = health.get("settings") or {}
    print(f"model {health.get('model')} ({health.get('backend')}, threads {st.get('n_threads')}, speculation "
          f"{(st.get('speculation') or {}).get('label')}, {health.get('n_slots')} slots), "
          f"{len(prompts)} prompts from {args.sets} x {args.rounds} rounds, {args.tokens} tokens, "
          f"greedy, streamed, one request at a time; paired ratios API / chat.completions: median (quartiles)")
    print(f"  chat.completions: TTFT median {statistics.median(r.ttft for r in ref) * 1e3:.1f} ms, decode "
          f"median {statistics.median(r.rate for r in ref):.1f} tok/s")
    for api in apis[1:]:
        rs = got[api]
        same = sum(a.text == b.text for a, b in zip(rs, ref))
        print(f"  {api}: {paired('decode rate', [a.rate / b.rate for a, b in zip(rs, ref)])}, "
              f"{paired('TTFT', [a.ttft / b.ttft for a, b in zip(rs, ref)])}, "
              f"same text {same}/{len(rs)}")
    if left:
        print(f"  not served here (404): {', '.join(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
