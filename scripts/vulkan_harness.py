#!/usr/bin/env python3
"""The harness scripts/vulkan_checks.py's checks share: a row of the table (`Row`), the commands
and settings they start the appliance with (`PY`, `QUICK`, `HIDDEN` for the CPU build), the
model they run (`TARGET`, set by `--model`), `appliance serve` in a child process (`Server`) and
a chat request to it, /health's placement planned against what llama.cpp allocated
(`buffers`, `placement_rows`), one serve start checked end to end (`serve_check`) and the
markdown table. It imports neither checks module.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

import served_outputs as so     # scripts/: the prompt sets' requests, a server's start and stop

MIB = 2**20
PY = [sys.executable, "-m", "appliance"]
QUICK = ["--plan", "off", "--speculate", "off", "--prompt-cache", "off", "--n-slots", "1"]
# the CPU build: an empty list of Vulkan devices (lavapipe is listed only when asked for; a
# discrete GPU is listed unless hidden so)
HIDDEN = {"GGML_VK_VISIBLE_DEVICES": ""}


@dataclass
class Target:
    """The model every check runs: `args` is spliced into its command lines ([] for the embedded
    model), `name` names it in the rows' conditions."""
    args: list[str] = field(default_factory=list)
    name: str = "embedded model"


# --model: every check serves, fits and sweeps this file instead of the embedded model (a machine
# without the embedded model's package: scripts/gpu_check.sh writes one with scripts/gpu_model.py).
# main() sets its fields; the checks read them when they run
TARGET = Target()


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
        model = [] if "--model" in args or "--library" in args else TARGET.args
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


def table(rows: list[Row]) -> str:
    lines = ["| check | figure | conditions | verdict |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.figure.replace('|', '/')} | {r.conditions.replace('|', '/')} | {r.verdict} |"
              for r in rows]
    return "\n".join(lines)
