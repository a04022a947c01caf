"""The MCP tool hub and the server's chat jobs together, for real: one `appliance serve` on the
embedded model with two stdio MCP servers given by --mcp (the toy server, its `add` logging each
call it runs: tests/web/toy_logged.py; and the plain toy server with `add` set to run unasked by
--mcp-auto-approve). Over HTTP, a conversation that chose the add tool asks a question, a job
forced to call it (tool_choice: the 135M model will not choose it alone) waits for the person;
approved, the tool message holds the tool's real result for the model's arguments and the job
goes on to its next reply and ends `done`, its events in order; denied, the tool message says so
and the tool never ran; auto-approved, the job never waits. --tool-steps 1 ends each job at its
second reply (the model calls the tool again whatever it was told), so every job is bounded."""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import requests

from ..mcp.toy import TOY
from .conftest import running_server, wait_until

LOGGED = str(Path(__file__).with_name("toy_logged.py"))
QUESTION = "What is 17 plus 25?"
STEP_LIMIT = "stopped at the step limit: 1 tool rounds (--tool-steps); the last reply's calls were not run"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp-jobs")
    calls = d / "calls.jsonl"
    py = shlex.quote(sys.executable)
    with running_server(d, "--n-ctx", "1024", "--n-slots", "1", "--thread-wait", "passive", "--speculate", "off",
                        "--prompt-cache", "off", "--tool-steps", "1",
                        "--mcp", f"toy={py} {shlex.quote(LOGGED)} {shlex.quote(str(calls))}",
                        "--mcp", f"auto={py} {shlex.quote(TOY)} stdio", "--mcp-auto-approve", "auto.add",
                        timeout=400) as srv:
        assert wait_until(lambda: _states(srv) == {"toy": "ready", "auto": "ready"}, timeout=120, interval=0.5)
        srv.calls = calls
        yield srv


def _states(server) -> dict:
    servers = requests.get(server.url + "/api/tools", timeout=60).json()["servers"]
    return {s["name"]: s["state"] for s in servers}


def tool_name(server, srv_name: str) -> dict:
    tools = requests.get(server.url + "/api/tools", timeout=60).json()["data"]
    return next(t for t in tools if t["server"] == srv_name and t["tool"] == "add")


def ran(server) -> list[dict]:
    return [json.loads(line) for line in server.calls.read_text().splitlines()] if server.calls.exists() else []


def start(server, tool: str) -> tuple[str, dict]:
    conv = requests.post(server.url + "/api/conversations", timeout=10, json={
        "title": "mcp job", "settings": {"tools": [tool]}, "messages": [{"role": "user", "content": QUESTION}]})
    assert conv.status_code == 201, conv.text
    assert conv.json()["settings"]["tools"] == [tool]
    body = {"request": {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48, "temperature": 0,
                        "seed": 7, "tool_choice": {"type": "function", "function": {"name": tool}}},
            "position": 1}
    r = requests.post(f"{server.url}/api/conversations/{conv.json()['id']}/jobs", json=body, timeout=60)
    assert r.status_code == 201, r.text
    return conv.json()["id"], r.json()


def until(server, job_id: str, states: tuple[str, ...], timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = requests.get(f"{server.url}/api/jobs/{job_id}", timeout=10).json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def events(server, job_id: str) -> list[dict]:
    text = requests.get(f"{server.url}/api/jobs/{job_id}/events", timeout=300).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def messages(server, conv_id: str) -> list[dict]:
    return requests.get(f"{server.url}/api/conversations/{conv_id}", timeout=10).json()["messages"]


def expected_result(server, tool: str, arguments: str) -> str:
    """What the tool message must hold for the model's arguments: the sum when they are two
    numbers (the toy's own formatting), else the hub's error as the job words it."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "not JSON"
    numbers = isinstance(args, dict) and set(args) == {"a", "b"} and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in args.values())
    if numbers:
        total = args["a"] + args["b"]
        return str(int(total) if total == int(total) else total)
    r = requests.post(server.url + "/api/tools/call", json={"name": tool, "arguments": args}, timeout=60).json()
    assert not r["ok"]
    return f"error: {r['error']}" + (f"\n{r['text']}" if r["text"] else "")


def collapsed(evs: list[dict]) -> list[tuple[str, int | None]]:
    """The events' types (with the position a message or chunk is at), runs of the same as one."""
    out: list[tuple[str, int | None]] = []
    for e in evs:
        key = (e["type"], e.get("position"))
        if not out or out[-1] != key:
            out.append(key)
    return out


def check_end(server, conv_id: str, job_id: str, tool_text: str) -> list[dict]:
    """The job ended done at its second reply; the conversation and the events say the same."""
    job = until(server, job_id, ("done", "stopped", "error", "cut_off"))
    stored = messages(server, conv_id)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == tool_text and stored[2]["tool_call_id"] == stored[1]["tool_calls"][0]["id"]
    final = stored[3]
    assert final["finish_reason"] in ("stop", "length", "tool_calls") and final["timings"]["predicted_n"] > 0
    assert job["state"] == "done" and job["steps"] == 1 and job["current"] == 3
    assert job["error"] == (STEP_LIMIT if final["tool_calls"] else None)
    evs = events(server, job_id)
    assert [e["seq"] for e in evs] == list(range(len(evs)))
    assert evs[-1]["type"] == "end" and evs[-1]["job"]["state"] == "done"
    tool_msgs = [e for e in evs if e["type"] == "message" and e["position"] == 2]
    assert [e["message"]["content"] for e in tool_msgs] == [tool_text]
    return evs


def test_an_approved_call_runs_the_real_tool_and_the_job_goes_on(server):
    tool = tool_name(server, "toy")
    assert not tool["auto_approve"]
    before = len(ran(server))
    conv_id, job = start(server, tool["name"])
    job = until(server, job["id"], ("waiting",))
    [call] = job["pending"]
    assert (call["name"], call["server"], call["decision"]) == (tool["name"], "toy", None)
    assert messages(server, conv_id)[1]["tool_calls"][0]["function"]["arguments"] == call["arguments"]
    r = requests.post(f"{server.url}/api/jobs/{job['id']}/calls/{call['id']}", json={"decision": "approve"}, timeout=10)
    assert r.status_code == 200, r.text
    until(server, job["id"], ("done", "stopped", "error", "cut_off"))
    want = expected_result(server, tool["name"], call["arguments"])
    assert want != "not JSON", call["arguments"]
    evs = check_end(server, conv_id, job["id"], want)
    if not want.startswith("error:"):       # the tool ran once, with the model's arguments
        assert ran(server)[before:] == [{k: float(v) for k, v in json.loads(call["arguments"]).items()}]
    assert collapsed(evs) == [("message", 1), ("chunk", 1), ("state", None), ("message", 2), ("state", None),
                              ("message", 3), ("chunk", 3), ("state", None), ("end", None)]
    waiting = next(e["job"] for e in evs if e["type"] == "state" and e["job"]["state"] == "waiting")
    assert waiting["pending"][0]["id"] == call["id"] and waiting["pending"][0]["decision"] is None
    text = "".join(c["function"]["arguments"] for e in evs if e["type"] == "chunk" and e["position"] == 1
                   and e["chunk"]["choices"] for c in e["chunk"]["choices"][0]["delta"].get("tool_calls") or [])
    assert text == call["arguments"]         # the forced call streamed as /v1 streams it
    assert any(e["type"] == "chunk" and "timings" in e["chunk"] for e in evs)


def test_a_denied_call_is_answered_denied_and_never_runs(server):
    tool = tool_name(server, "toy")
    before = ran(server)
    conv_id, job = start(server, tool["name"])
    [call] = until(server, job["id"], ("waiting",))["pending"]
    r = requests.post(f"{server.url}/api/jobs/{job['id']}/calls/{call['id']}", json={"decision": "deny"}, timeout=10)
    assert r.status_code == 200, r.text
    evs = check_end(server, conv_id, job["id"], "denied by the user")
    assert ran(server) == before             # the toy server never ran it
    decided = [e["job"]["pending"] for e in evs if e["type"] == "state" and e["job"]["pending"]]
    assert decided[-1][0]["decision"] == "deny" and decided[-1][0]["result"] == {"ok": False, "denied": True}


def test_an_auto_approved_tool_runs_without_waiting(server):
    tool = tool_name(server, "auto")
    assert tool["auto_approve"]
    conv_id, job = start(server, tool["name"])
    job = until(server, job["id"], ("done", "stopped", "error", "cut_off", "waiting"))
    assert job["state"] != "waiting"
    call = messages(server, conv_id)[1]["tool_calls"][0]["function"]
    evs = check_end(server, conv_id, job["id"], expected_result(server, tool["name"], call["arguments"]))
    states = [e["job"]["state"] for e in evs if e["type"] in ("state", "end")]
    assert "waiting" not in states
    decided = [e["job"]["pending"] for e in evs if e["type"] == "state" and e["job"]["pending"]]
    assert decided and decided[-1][0]["decision"] == "auto"
