#!/usr/bin/env python3
"""The coding agents on the embedded model: what the prompt cache serves of each turn, and how
long each turn takes (issue 69). Two parts, each agent in turn (Codex CLI on the Responses wire,
Claude Code, opencode), from tests/agents' pinned npm packages:

- `scripted`: the agent's two-step tool session (a call of its shell tool running `echo
  appliance-ok`, then the answer) on the embedded SmolLM2 through llama.cpp, the replies
  scripted in SmolLM2's tool format (tests/engine/scripted_runner.py's ReplayRunner: every
  forward runs on the model, so the prefill, the KV cache, the prompt cache's reuse and the
  times are real; only the sampled tokens are the script's). One slot, prompt cache on, the
  engine's scheduler in-process behind the real app. Per request: prompt tokens, those read from
  the cache, their share, and the request's wall time at the server.
- `real`: one turn of each agent against `appliance serve` on the embedded model (its own
  replies), with a real prefill of the agent's whole first prompt: the exit status, the wall
  time, and the server's prompt and cached token counts from /metrics.

    python scripts/agent_turns.py                       # both parts, --n-ctx 32768 with YaRN
    python scripts/agent_turns.py --part scripted --agents claude --claude-env API_TIMEOUT_MS=900000
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.config import EngineConfig  # noqa: E402
from appliance.models import embedded_model_path  # noqa: E402
from tests.web import agents as A  # noqa: E402

AGENTS = {"codex": A.CODEX, "claude": A.CLAUDE, "opencode": A.OPENCODE}
MODEL = "smollm2"


CLAUDE_ENV: dict[str, str] = {}


def launch(agent: A.Agent, bin_dir: Path, url: str, cwd: Path, n_ctx: int):
    if agent is A.CODEX:
        return A.run_codex(bin_dir, url, MODEL, cwd, timeout=1800)
    if agent is A.CLAUDE:
        return A.run_claude(bin_dir, url, MODEL, cwd, timeout=1800, env=CLAUDE_ENV)
    return A.run_opencode(bin_dir, url, MODEL, cwd, n_ctx, output=1024, timeout=1800)


def scripted(agent: A.Agent, bin_dir: Path, n_ctx: int) -> None:
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from tests.engine.scripted_runner import ReplayRunner
    from tests.web.scripted_engine import ScriptedEngine, app_for, serve

    cfg = EngineConfig(n_ctx=n_ctx, n_slots=1, rope_scaling="yarn", prompt_cache="on", plan="off")
    runner = ReplayRunner(LlamaCppRunner(cfg, embedded_model_path(), MODEL))
    engine = ScriptedEngine(None, prompt_cache="on", director=A.director(A.HERMES, agent), runner=runner)
    with tempfile.TemporaryDirectory() as tmp:
        app = app_for(engine, tmp, agent.name, model_name=MODEL)
        seen = A.record(app)
        with serve(app) as url:
            t0 = time.perf_counter()
            done = launch(agent, bin_dir, url, Path(tmp), n_ctx)
            wall = time.perf_counter() - t0
    print(f"\n{agent.name} (scripted tool session): exit {done.returncode}, {wall:.1f} s in all, "
          f"final answer {'printed' if A.FINAL in done.stdout else 'MISSING'}")
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:])
    turns = [r for r in seen if r["method"] == "POST" and r["path"].startswith(("/v1/", "/api/"))
             and r["path"] != "/v1/messages/count_tokens"]
    print("| request | route | prompt tokens | read from cache | share | time at the server, s |")
    print("|---|---|---|---|---|---|")
    for i, (r, (n, cached)) in enumerate(zip(turns, engine.turns), 1):
        print(f"| {i} | {r['path']} | {n} | {cached} | {cached / n:.1%} | {r.get('s', float('nan')):.1f} |")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def real(agent: A.Agent, bin_dir: Path, n_ctx: int) -> None:
    import requests

    from tests.web.conftest import running_server

    with tempfile.TemporaryDirectory() as tmp:
        with running_server(Path(tmp), "--n-ctx", str(n_ctx), "--rope-scaling", "yarn", "--n-slots", "1",
                            "--model-alias", MODEL) as server:
            before = requests.get(server.url + "/metrics", timeout=10).text
            t0 = time.perf_counter()
            done = launch(agent, bin_dir, server.url, Path(tmp), n_ctx)
            wall = time.perf_counter() - t0
            time.sleep(0.5)     # the engine's counters reach the server about ten times a second
            after = requests.get(server.url + "/metrics", timeout=10).text
    prompt = metric(after, "appliance_prompt_tokens_total") - metric(before, "appliance_prompt_tokens_total")
    cached = metric(after, "appliance_prompt_cache_hit_tokens_total") - metric(before, "appliance_prompt_cache_hit_tokens_total")
    print(f"\n{agent.name} (one turn, the model's own replies): exit {done.returncode}, {wall:.1f} s, "
          f"{prompt:.0f} prompt tokens through the engine, {cached:.0f} of them read from the cache")
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("scripted", "real", "both"), default="both")
    ap.add_argument("--agents", default="codex,claude,opencode")
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--claude-env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of Claude Code's environment for its runs, to try it")
    args = ap.parse_args()
    CLAUDE_ENV.update(kv.split("=", 1) for kv in args.claude_env)
    bin_dir = A.agents_bin()
    if bin_dir is None:
        print("npm is not installed: the coding agents come from npm", file=sys.stderr)
        return 2
    for name in args.agents.split(","):
        if args.part in ("scripted", "both"):
            scripted(AGENTS[name], bin_dir, args.n_ctx)
        if args.part in ("real", "both"):
            real(AGENTS[name], bin_dir, args.n_ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
