"""The coding agents, run as their users run them against a local server: Codex CLI (`codex exec`,
a Responses-wire model provider, or `--oss` with Ollama), Claude Code (`claude -p` with
ANTHROPIC_BASE_URL) and opencode (`opencode run` with an OpenAI-compatible provider), installed
from npm at the versions tests/agents/package-lock.json pins. Each runs in a directory of its
own with its own HOME, telemetry, update checks and model lists off (each agent's own switches),
and only the server's address.

A scripted model for them (tests/web/scripted_engine.py): `director` replies to each request in
a model's own format: while the agent's shell tool has not answered, a call of it that runs
`echo appliance-ok`; once its result is in the prompt, the final answer; to any other request (a
title, a summary) a short text. `record` keeps what the server saw. Used by
tests/web/test_agents_e2e.py and scripts/agent_turns.py.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

AGENTS_DIR = Path(__file__).resolve().parents[1] / "agents"
MARKER = "appliance-ok"
FINAL = f"The command printed {MARKER}."
SIDE = "Scripted reply."          # to requests without the shell tool: titles, summaries
PROMPT = f"Run `echo {MARKER}` in the shell."


# -- the models' own formats ---------------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    template: str
    call: Callable[[str, dict], str]
    text: Callable[[str], str]


def _gpt_oss_call(name: str, args: dict) -> str:
    return (f"<|channel|>analysis<|message|>I run the command.<|end|><|start|>assistant to=functions.{name}"
            f"<|channel|>commentary json<|message|>{json.dumps(args)}")


def _qwen3_coder_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm_call(name: str, args: dict) -> str:
    params = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"I run the command.</think><tool_call>{name}{params}</tool_call>"


def _hermes_call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


GPT_OSS = Format("openai-gpt-oss-120b", _gpt_oss_call, lambda text: f"<|channel|>final<|message|>{text}")
QWEN3_CODER = Format("Qwen3-Coder", _qwen3_coder_call, lambda text: text)
GLM = Format("GLM-4.7-Flash", _glm_call, lambda text: f"Done.</think>{text}")
HERMES = Format("", _hermes_call, lambda text: text)     # the generic format: the embedded SmolLM2's


@dataclass(frozen=True)
class Agent:
    name: str
    tool: str          # its shell tool
    args: dict         # the call of it that runs `echo appliance-ok`
    path: str          # the route its turns take


CODEX = Agent("codex", "exec_command", {"cmd": f"echo {MARKER}"}, "/v1/responses")
CLAUDE = Agent("claude", "Bash", {"command": f"echo {MARKER}", "description": "Print the marker"}, "/v1/messages")
OPENCODE = Agent("opencode", "bash", {"command": f"echo {MARKER}"}, "/v1/chat/completions")


def director(fmt: Format, agent: Agent) -> Callable[[Any], str]:
    """The scripted model: a call of the shell tool, then the answer once its result is in."""
    def reply(request) -> str:
        results = [m.content for m in request.messages or () if m.role == "tool"]
        if any(isinstance(r, str) and MARKER in r for r in results):
            return fmt.text(FINAL)
        if any(t.name == agent.tool for t in request.tools):
            return fmt.call(agent.tool, agent.args)
        return fmt.text(SIDE)
    return reply


# -- the agents ----------------------------------------------------------------------------------
def agents_bin(install: bool = True) -> Path | None:
    """The pinned agents' executables: npm install of tests/agents' lock file once (.ci/run does
    it first); None without npm."""
    bin_dir = AGENTS_DIR / "node_modules" / ".bin"
    if not all((bin_dir / b).exists() for b in ("codex", "claude", "opencode")):
        if shutil.which("npm") is None or not install:
            return None
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AGENTS_DIR,
                       check=True, timeout=600)
    return bin_dir


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # a clean environment: the agent's own HOME, no proxy, no key of the developer's
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return subprocess.run(argv, env={**keep, "HOME": str(cwd / "home"), **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def run_codex(bin_dir: Path, url: str, model: str, cwd: Path, oss: bool = False, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    home = cwd / "home" / ".codex"
    home.mkdir(parents=True, exist_ok=True)
    config = 'check_for_update_on_startup = false\n'
    if not oss:
        config = (f'model = "{model}"\nmodel_provider = "appliance"\n' + config +
                  f'[model_providers.appliance]\nname = "appliance"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    (home / "config.toml").write_text(config + '[analytics]\nenabled = false\n[features]\nplugins = false\n')
    oss_args = ["--oss", "--local-provider", "ollama", "-m", model] if oss else []
    return _run([str(bin_dir / "codex"), "exec", *oss_args, "--skip-git-repo-check", "-s", "danger-full-access",
                 PROMPT], {**({"CODEX_OSS_BASE_URL": f"{url}/v1"} if oss else {}), **(env or {})}, cwd, timeout)


def run_claude(bin_dir: Path, url: str, model: str, cwd: Path, timeout: float = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`env`: more of Claude Code's environment."""
    return _run([str(bin_dir / "claude"), "-p", "--model", model, "--allowedTools=Bash", PROMPT],
                {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-local",
                 "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                 "DISABLE_AUTOUPDATER": "1", **(env or {})}, cwd, timeout)


def run_opencode(bin_dir: Path, url: str, model: str, cwd: Path, n_ctx: int, output: int = 4096,
                 timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """opencode asks for max_tokens = its model's output limit (32000 unless told): `limit` says
    the context and output the server has, as its docs ask for a local model."""
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "permission": {"bash": "allow"}, "model": f"appliance/{model}",
              "provider": {"appliance": {"npm": "@ai-sdk/openai-compatible", "name": "appliance",
                                         "options": {"baseURL": f"{url}/v1", "apiKey": "sk-local"},
                                         "models": {model: {"name": model, "tool_call": True,
                                                            "limit": {"context": n_ctx, "output": output}}}}}}
    (cwd / "opencode.json").write_text(json.dumps(config))
    return _run([str(bin_dir / "opencode"), "run", PROMPT],
                {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                 "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                 "OPENCODE_DISABLE_SHARE": "1", **(env or {})}, cwd, timeout)


class Tripwire:
    """A proxy that connects nowhere: the agents run with it as their HTTP(S) proxy (the
    server's address exempt), and `hosts` lists each host one of them tried to reach."""

    def __init__(self) -> None:
        self.hosts: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()
        url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.env = {"HTTPS_PROXY": url, "HTTP_PROXY": url, "https_proxy": url, "http_proxy": url,
                    "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:      # closed
                return
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.recv(512).split(b"\r\n", 1)[0].decode("latin-1").split()
                except OSError:
                    continue
                if len(line) >= 2:   # CONNECT host:443 HTTP/1.1, or GET http://host/... HTTP/1.1
                    self.hosts.append(line[1].split("://")[-1].split("/")[0].rsplit(":", 1)[0])

    def close(self) -> None:
        self.sock.close()


def record(app) -> list[dict[str, Any]]:
    """What the app sees from now on: each request's method, path, JSON body, status, wall time
    to the end of its reply's first write (a stream's whole time is in `s`), in order."""
    from flask import g, request

    seen: list[dict[str, Any]] = []

    @app.before_request
    def asked():
        g.seen = {"path": request.path, "method": request.method, "body": request.get_json(silent=True),
                  "t0": time.perf_counter()}
        seen.append(g.seen)

    @app.after_request
    def answered(response):
        g.seen.update(status=response.status_code,
                      reply=None if response.is_streamed else response.get_data(as_text=True))
        start, seen_now = g.seen["t0"], g.seen

        def closed() -> None:
            seen_now["s"] = time.perf_counter() - start
        response.call_on_close(closed)
        return response

    return seen
