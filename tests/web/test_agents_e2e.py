"""The coding agents people point at a local server, unchanged, end to end (tests/web/agents.py
runs them): Codex CLI on the Responses wire and in its `--oss` Ollama mode, Claude Code on
Anthropic Messages, opencode on OpenAI chat, each against the app on a real socket.

The model is scripted (tests/web/scripted_engine.py): a tiny GGUF carries the chat template of a
model people run with that agent (gpt-oss for Codex, Qwen3-Coder for Claude Code, GLM-4.7 for
opencode) and replies in that model's own format: a call of the agent's shell tool that runs
`echo appliance-ok`, then the final answer once the result is in. The agent must offer its tools,
run the call, send the result back, print the answer and exit 0; the test reads the protocol
exchange the server saw, and that the agent tried to reach nothing else (`Tripwire`, its proxy:
Codex with plugins off, Claude Code with nonessential traffic off, opencode but for its npm
plugin install). The engine keeps one slot with the prompt cache on, as `serve --n-slots
1` does, so each follow-up turn is served from the cache (`usage.cached_tokens`, the engine's own
count; the same session on the embedded model, timed: scripts/agent_turns.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import agents as A
from .scripted_engine import ScriptedEngine, app_for, model, serve

N_CTX = 131072      # Claude Code's first prompt is ~21k tokens of SmolLM2's vocabulary; 32000 max_tokens fit


# what each agent may reach besides the server: opencode installs its plugin package from npm
# into its config directory at every start (it runs on without it), and has no switch for that
REACHES = {"codex": set(), "claude": set(), "opencode": {"registry.npmjs.org"}}


@pytest.fixture
def tripwire():
    wire = A.Tripwire()
    yield wire
    wire.close()


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    found = A.agents_bin()
    if found is None:
        pytest.skip("npm is not installed: the coding agents come from npm (Node 20)")
    return found


@dataclass
class Session:
    """A scripted server for one agent, and what it saw."""
    url: str
    engine: ScriptedEngine
    seen: list[dict[str, Any]]

    def turns(self, path: str) -> list[dict[str, Any]]:
        turns = [r for r in self.seen if r["method"] == "POST" and r["path"] == path]
        assert turns and all(t["status"] == 200 for t in turns), [(t["path"], t["status"]) for t in self.seen]
        return turns

    def follow_up_cached(self) -> None:
        """The agent's last turn continues its first: the cache serves all but its new tail."""
        (n_first, _), (n_last, cached) = self.engine.turns[-2], self.engine.turns[-1]
        assert n_last > n_first and cached >= n_first - 512, self.engine.turns


def session(tmp_path: Path, fmt: A.Format, agent: A.Agent, name: str):
    engine = ScriptedEngine(model(fmt.template, str(tmp_path)), n_ctx=N_CTX, prompt_cache="on",
                            director=A.director(fmt, agent))
    app = app_for(engine, str(tmp_path), fmt.template, model_name=name)
    seen = A.record(app)
    return engine, app, seen


@pytest.mark.parametrize("oss,name", [(False, "gpt-oss:20b"), (True, "gpt-oss:20b"), (False, "gpt-5.5")],
                         ids=["responses", "oss-ollama", "responses-as-gpt-5.5"])
def test_codex_runs_a_tool_over_the_responses_wire(bin_dir, tmp_path, oss, name, tripwire):
    """`codex exec` with a model provider on the Responses wire, and `codex exec --oss` (its
    Ollama mode: /api/version, /api/tags, then the same wire), on gpt-oss: Codex's request has a
    namespace tool, web_search, two developer messages and client_metadata. Served under the
    name of a model Codex knows (gpt-5.5), it sends apply_patch as a custom tool and tool_search."""
    engine, app, seen = session(tmp_path, A.GPT_OSS, A.CODEX, name)
    with serve(app) as url:
        done = A.run_codex(bin_dir, url, name, tmp_path, oss=oss, env=tripwire.env)
    s = Session(url, engine, seen)
    assert done.returncode == 0, done.stdout + done.stderr
    assert A.FINAL in done.stdout
    turns = s.turns("/v1/responses")
    first, last = turns[0]["body"], turns[-1]["body"]
    assert {t["type"] for t in first["tools"]} >= {"function", "web_search",
                                                    *(["custom", "tool_search"] if "5.5" in name else ["namespace"])}
    call = next(i for i in last["input"] if i.get("type") == "function_call")
    assert (call["name"], json.loads(call["arguments"])) == (A.CODEX.tool, A.CODEX.args)
    output = next(i for i in last["input"] if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"] and A.MARKER in json.dumps(output["output"])
    s.follow_up_cached()
    assert set(tripwire.hosts) <= REACHES["codex"], tripwire.hosts
    if oss:
        assert [r["path"] for r in seen if r["method"] == "GET"][-2:] == ["/api/version", "/api/tags"]


def test_claude_code_runs_a_tool_over_anthropic_messages(bin_dir, tmp_path, tripwire):
    """`claude -p` with ANTHROPIC_BASE_URL on Qwen3-Coder: its ~21k-token first request (24 tools,
    a system message inside `messages`, adaptive thinking, effort, context_management,
    max_tokens 32000)."""
    engine, app, seen = session(tmp_path, A.QWEN3_CODER, A.CLAUDE, "qwen3-coder")
    with serve(app) as url:
        done = A.run_claude(bin_dir, url, "qwen3-coder", tmp_path, env=tripwire.env)
    s = Session(url, engine, seen)
    assert done.returncode == 0, done.stdout + done.stderr
    assert A.FINAL in done.stdout
    turns = s.turns("/v1/messages")
    first, last = turns[0]["body"], turns[-1]["body"]
    assert "Bash" in {t["name"] for t in first["tools"]} and first["max_tokens"] > 8192
    assert any(m["role"] == "system" for m in first["messages"])
    blocks = [b for m in last["messages"] if isinstance(m["content"], list) for b in m["content"]]
    use = next(b for b in blocks if b["type"] == "tool_use")
    assert (use["name"], use["input"]) == (A.CLAUDE.tool, A.CLAUDE.args)
    result = next(b for b in blocks if b["type"] == "tool_result")
    assert result["tool_use_id"] == use["id"] and A.MARKER in json.dumps(result["content"])
    s.follow_up_cached()
    assert set(tripwire.hosts) <= REACHES["claude"], tripwire.hosts


def test_opencode_runs_a_tool_over_openai_chat(bin_dir, tmp_path, tripwire):
    """`opencode run` with an OpenAI-compatible provider (its own way to a local server) on GLM-4.7."""
    engine, app, seen = session(tmp_path, A.GLM, A.OPENCODE, "glm-4.7-flash")
    with serve(app) as url:
        done = A.run_opencode(bin_dir, url, "glm-4.7-flash", tmp_path, N_CTX, env=tripwire.env)
    s = Session(url, engine, seen)
    assert done.returncode == 0, done.stdout + done.stderr
    assert A.FINAL in done.stdout
    last = s.turns("/v1/chat/completions")[-1]["body"]["messages"]
    call = next(c for m in last for c in m.get("tool_calls") or [])
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (A.OPENCODE.tool, A.OPENCODE.args)
    result = next(m for m in last if m["role"] == "tool")
    assert result["tool_call_id"] == call["id"] and A.MARKER in json.dumps(result["content"])
    s.follow_up_cached()
    assert set(tripwire.hosts) <= REACHES["opencode"], tripwire.hosts


def test_the_tripwire_names_a_host_a_client_tried_to_reach(tripwire):
    import requests

    with pytest.raises(requests.exceptions.RequestException):
        requests.get("https://vendor.example/telemetry", timeout=5,
                     proxies={"https": tripwire.env["HTTPS_PROXY"], "http": tripwire.env["HTTP_PROXY"]})
    assert tripwire.hosts == ["vendor.example"]
