"""The coding agents people point at a local server, unchanged, end to end: Codex CLI (the
Responses wire, and its `--oss` Ollama mode), Claude Code (Anthropic Messages) and opencode
(OpenAI chat), each installed from npm at the versions tests/agents/package-lock.json pins,
each run non-interactively against the app on a real socket.

The model is scripted (tests/web/scripted_engine.py): a tiny GGUF carries the chat template of
a model people run with that agent (gpt-oss for Codex, Qwen3-Coder for Claude Code, GLM-4.7 for
opencode), and the reply to each request is written in that model's own format: while the
agent's shell tool has not answered, a call of it that runs `echo appliance-ok`; once its result
is in the prompt, a final answer; to any other request (a title, a summary) a short text. The
agent must offer its tools, run the call, send the result back, print the final answer and exit
0; the test reads the protocol exchange the server saw. The engine keeps one slot with the
prompt cache on, so each follow-up turn's `cached_tokens` is the engine's own count.

The agents' telemetry, update checks and model lists are off (each agent's own switches); the
only address any of them is given is the app's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from appliance.engine.types import Request

from .scripted_engine import ScriptedEngine, app_for, model, serve

AGENTS_DIR = Path(__file__).resolve().parents[1] / "agents"
MARKER = "appliance-ok"
FINAL = f"The command printed {MARKER}."
SIDE = "Scripted reply."          # to requests without the shell tool: titles, summaries
N_CTX = 131072                    # Claude Code's first prompt alone is ~40k tokens of SmolLM2's vocabulary


def gpt_oss_call(name: str, args: dict) -> str:
    return (f"<|channel|>analysis<|message|>I run the command.<|end|><|start|>assistant to=functions.{name}"
            f"<|channel|>commentary json<|message|>{json.dumps(args)}")


def qwen3_coder_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm_call(name: str, args: dict) -> str:
    params = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"I run the command.</think><tool_call>{name}{params}</tool_call>"


@dataclass(frozen=True)
class Format:
    template: str
    call: Callable[[str, dict], str]
    text: Callable[[str], str]


GPT_OSS = Format("openai-gpt-oss-120b", gpt_oss_call, lambda text: f"<|channel|>final<|message|>{text}")
QWEN3_CODER = Format("Qwen3-Coder", qwen3_coder_call, lambda text: text)
GLM = Format("GLM-4.7-Flash", glm_call, lambda text: f"Done.</think>{text}")


def director(fmt: Format, tool: str, args: dict) -> Callable[[Request], str]:
    """The scripted model: a call of the shell tool, then the answer once its result is in."""
    def reply(request: Request) -> str:
        results = [m.content for m in request.messages or () if m.role == "tool"]
        if any(isinstance(r, str) and MARKER in r for r in results):
            return fmt.text(FINAL)
        if any(t.name == tool for t in request.tools):
            return fmt.call(tool, args)
        return fmt.text(SIDE)
    return reply


# -- the agents -------------------------------------------------------------------------------
def agents_bin() -> Path:
    """The pinned agents' executables: npm ci of tests/agents once (.ci/run does it first)."""
    bin_dir = AGENTS_DIR / "node_modules" / ".bin"
    if not all((bin_dir / b).exists() for b in ("codex", "claude", "opencode")):
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: the coding agents come from npm (Node 20)")
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AGENTS_DIR, check=True,
                       timeout=600)
    return bin_dir


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return agents_bin()


@dataclass
class Session:
    """A scripted server for one agent, and what it saw."""
    url: str
    engine: ScriptedEngine
    seen: list[dict[str, Any]]     # each request: path, body, status, and the reply's body when not streamed


@pytest.fixture
def session(tmp_path, request):
    fmt, tool, args, name = request.param
    engine = ScriptedEngine(model(fmt.template, str(tmp_path)), n_ctx=N_CTX, prompt_cache="on",
                            director=director(fmt, tool, args))
    app = app_for(engine, str(tmp_path), fmt.template, model_name=name)
    seen: list[dict[str, Any]] = []

    @app.before_request
    def asked():
        from flask import g, request as req

        g.seen = {"path": req.path, "method": req.method, "body": req.get_json(silent=True)}
        seen.append(g.seen)

    @app.after_request
    def answered(response):
        from flask import g

        g.seen.update(status=response.status_code,
                      reply=None if response.is_streamed else response.get_data(as_text=True))
        return response

    with serve(app) as url:
        yield Session(url, engine, seen)


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    # a clean environment: the agent's own HOME, no proxy, no key of the developer's
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    done = subprocess.run(argv, env={**keep, "HOME": str(cwd / "home"), **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return done


def posts(s: Session, path: str) -> list[dict[str, Any]]:
    return [r for r in s.seen if r["method"] == "POST" and r["path"] == path]


CODEX = (GPT_OSS, "exec_command", {"cmd": f"echo {MARKER}"}, "gpt-oss:20b")


def codex(bin_dir: Path, s: Session, tmp_path: Path, oss: bool) -> subprocess.CompletedProcess:
    home = tmp_path / "home" / ".codex"
    home.mkdir(parents=True)
    config = 'check_for_update_on_startup = false\n'
    if not oss:
        config = ('model = "gpt-oss:20b"\nmodel_provider = "appliance"\n' + config +
                  f'[model_providers.appliance]\nname = "appliance"\nbase_url = "{s.url}/v1"\nwire_api = "responses"\n')
    (home / "config.toml").write_text(config + '[analytics]\nenabled = false\n')
    oss_args = ["--oss", "--local-provider", "ollama"] if oss else []
    return run([str(bin_dir / "codex"), "exec", *oss_args, "--skip-git-repo-check", "-s", "danger-full-access",
                f"Run `echo {MARKER}` in the shell."], {"CODEX_OSS_BASE_URL": f"{s.url}/v1"} if oss else {}, tmp_path)


@pytest.mark.parametrize("session", [CODEX], indirect=True, ids=["gpt-oss"])
@pytest.mark.parametrize("oss", [False, True], ids=["responses", "oss-ollama"])
def test_codex_runs_a_tool_over_the_responses_wire(bin_dir, session, tmp_path, oss):
    """`codex exec` with a model provider on the Responses wire, and `codex exec --oss` (its
    Ollama mode: /api/version, /api/tags, then the same Responses wire)."""
    done = codex(bin_dir, session, tmp_path, oss)
    assert done.returncode == 0, done.stdout + done.stderr
    assert FINAL in done.stdout
    turns = posts(session, "/v1/responses")
    assert all(t["status"] == 200 for t in turns), [t for t in turns if t["status"] != 200]
    first, second = turns[0]["body"], turns[-1]["body"]
    assert {t["type"] for t in first["tools"]} >= {"function", "namespace", "web_search"}
    call = next(i for i in second["input"] if i.get("type") == "function_call")
    assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": f"echo {MARKER}"})
    output = next(i for i in second["input"] if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"] and MARKER in json.dumps(output["output"])


CLAUDE = (QWEN3_CODER, "Bash", {"command": f"echo {MARKER}", "description": "Print the marker"}, "qwen3-coder")


@pytest.mark.parametrize("session", [CLAUDE], indirect=True, ids=["qwen3-coder"])
def test_claude_code_runs_a_tool_over_anthropic_messages(bin_dir, session, tmp_path):
    """`claude -p` with ANTHROPIC_BASE_URL: its ~40k-token first request (24 tools, a system
    message inside `messages`, adaptive thinking, effort, context_management, max_tokens 32000)."""
    done = run([str(bin_dir / "claude"), "-p", "--model", "qwen3-coder", "--allowedTools=Bash",
                f"Run `echo {MARKER}` in the shell."],
               {"ANTHROPIC_BASE_URL": session.url, "ANTHROPIC_API_KEY": "sk-local",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1"}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert FINAL in done.stdout
    turns = posts(session, "/v1/messages")
    assert all(t["status"] == 200 for t in turns), [t for t in turns if t["status"] != 200]


OPENCODE = (GLM, "bash", {"command": f"echo {MARKER}"}, "glm-4.7-flash")


@pytest.mark.parametrize("session", [OPENCODE], indirect=True, ids=["glm-4.7"])
def test_opencode_runs_a_tool_over_openai_chat(bin_dir, session, tmp_path):
    """`opencode run` with an OpenAI-compatible provider (its own way to a local server)."""
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "permission": {"bash": "allow"}, "model": "appliance/glm-4.7-flash",
              "provider": {"appliance": {"npm": "@ai-sdk/openai-compatible", "name": "appliance",
                                         "options": {"baseURL": f"{session.url}/v1", "apiKey": "sk-local"},
                                         "models": {"glm-4.7-flash": {"name": "GLM-4.7-Flash", "tool_call": True,
                                                                      "limit": {"context": N_CTX, "output": 4096}}}}}}
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    done = run([str(bin_dir / "opencode"), "run", f"Run `echo {MARKER}` in the shell."],
               {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert FINAL in done.stdout
    turns = posts(session, "/v1/chat/completions")
    assert all(t["status"] == 200 for t in turns), [t for t in turns if t["status"] != 200]
    last = turns[-1]["body"]["messages"]
    call = next(c for m in last for c in m.get("tool_calls") or [])
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == OPENCODE[1:3]
    result = next(m for m in last if m["role"] == "tool")
    assert result["tool_call_id"] == call["id"] and MARKER in json.dumps(result["content"])
