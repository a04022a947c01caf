"""A worker's host facts (issue 52): served on the port after its RPC port, printed by
`appliance hostcheck --rpc`, stored by bench beside a split and shown in the run's report. These
run anywhere (no RPC build): the facts server is started here as `appliance worker` starts it;
tests/engine/test_rpc.py checks a real worker answers."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from appliance import worker_facts
from appliance.bench.report_host import host_lines
from appliance.cli import main
from appliance.endpoints import Endpoint

WORKER = {"endpoint": "", "cache": None, "threads": 1,
          "offers": [{"name": "CPU", "description": "AMD EPYC", "free": 2**33, "total": 2**34}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def facts_at():
    """A facts server as a worker at 127.0.0.1:<P> runs it (on P + 1); yields the RPC endpoint."""
    rpc = Endpoint("127.0.0.1", free_port() - 1)
    server = worker_facts.serve(worker_facts.facts_endpoint(rpc), {**WORKER, "endpoint": str(rpc)})
    yield rpc
    server.shutdown()


def dead_endpoint() -> Endpoint:
    return Endpoint("127.0.0.1", free_port() - 1)    # nothing listens on the port after it


def test_a_worker_answers_with_its_hostcheck_and_what_it_serves(facts_at):
    facts = worker_facts.fetch(facts_at)
    assert facts["worker"]["endpoint"] == str(facts_at) and facts["worker"]["offers"][0]["name"] == "CPU"
    snap = facts["snapshot"]
    assert snap["memory"]["total_bytes"] > 0 and "cmdline" in snap["kernel"] and "cpu" in snap
    assert "advice" in facts and "Kernel" in facts["text"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{worker_facts.facts_endpoint(facts_at)}/other", timeout=5)
    assert e.value.code == 404


def test_a_worker_that_does_not_answer_is_said_not_raised():
    ep = dead_endpoint()
    facts = worker_facts.fetch(ep, timeout_s=2)
    assert list(facts) == ["error"] and f"127.0.0.1:{ep.port + 1}/hostcheck" in facts["error"]


def test_hostcheck_rpc_prints_each_workers_report(facts_at, capsys):
    dead = dead_endpoint()
    assert main(["hostcheck", "--rpc", str(facts_at)]) == 0
    out = capsys.readouterr().out
    assert f"== RPC worker {facts_at} ==" in out and out.count("kernel") >= 2
    assert main(["hostcheck", "--rpc", f"{facts_at},{dead}", "--json"]) == 1     # one did not answer
    body = json.loads(capsys.readouterr().out)
    assert set(body["workers"]) == {str(facts_at), str(dead)} and "error" in body["workers"][str(dead)]
    assert "snapshot" in body and body["workers"][str(facts_at)]["worker"]["threads"] == 1
    assert main(["hostcheck", "--rpc", "nope"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_bench_stores_every_workers_facts_and_the_report_shows_them(facts_at):
    from appliance.bench.session import host_snapshot

    dead = dead_endpoint()
    health = {"placement": {"llama_devices": [
        {"name": "CPU", "description": "AMD EPYC"},
        {"name": "RPC0", "description": str(facts_at)}, {"name": "RPC1", "description": str(dead)}]}}
    assert worker_facts.remote_endpoints(health) == [facts_at, dead]
    snap = host_snapshot([SimpleNamespace(health=health), SimpleNamespace(health={})])
    assert set(snap["workers"]) == {str(facts_at), str(dead)} and "memory" in snap
    lines = host_lines(json.loads(json.dumps(snap)))      # as stored in SQLite
    assert f"- RPC worker {facts_at}, offering CPU 16.0 GiB:" in lines
    mine = lines.index(f"- RPC worker {facts_at}, offering CPU 16.0 GiB:")
    assert lines[mine + 1].startswith("  - host snapshot:") and any(x.startswith("  - kernel command line") for x in lines)
    assert any(x.startswith(f"- RPC worker {dead}: facts unavailable (") for x in lines)
    assert "workers" not in host_snapshot([SimpleNamespace(health={"placement": {"llama_devices": []}})])


def answering(port: int, status: int, body: bytes) -> ThreadingHTTPServer:
    """Another program's HTTP server on `port` (0: any), answering every GET with `status` and
    `body`; shut it down and close it when done."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # http.server's name
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def foreign():
    """`foreign(status, body)`: another program answering so on a worker's facts port; returns
    the RPC endpoint whose next port it holds."""
    servers = []

    def start(status: int, body: bytes) -> Endpoint:
        servers.append(answering(0, status, body))
        return Endpoint("127.0.0.1", servers[-1].server_address[1] - 1)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_another_program_on_the_facts_port_is_an_error_naming_it_not_the_workers_facts(foreign):
    """Issue 68: a worker whose facts port another program holds (its facts not served) must not
    pass that program's answer off as the worker's facts."""
    for status, body in ((200, b'{"status": "ok", "snapshot": {}}'), (200, b"[1, 2]"), (200, b"<html>"),
                         (200, b'{"worker": "yes"}'), (404, b'{"detail": "Not Found"}')):
        ep = foreign(status, body)
        facts = worker_facts.fetch(ep, timeout_s=30)
        assert list(facts) == ["error"], (status, body, facts)
        assert f"127.0.0.1:{ep.port + 1}/hostcheck answered" in facts["error"]
        assert f"not as the worker at {ep}" in facts["error"], facts["error"]


def test_another_workers_facts_on_the_port_are_not_taken_for_this_ones(facts_at):
    """The facts server at facts_at's next port answers for the worker at facts_at: asked as the
    facts of a worker on another RPC port (one whose own facts port it is), it is refused."""
    other = Endpoint("127.0.0.1", facts_at.port - 7)
    facts = worker_facts.fetch(other, timeout_s=30, facts_port=facts_at.port + 1)
    assert list(facts) == ["error"] and f"not as the worker at {other}" in facts["error"]
    assert f"the facts of a worker serving {facts_at}" in facts["error"]
    # named by another name for its host, the worker is still itself
    assert "error" not in worker_facts.fetch(Endpoint("localhost", facts_at.port), timeout_s=30)


def test_hostcheck_asks_on_the_facts_port_it_is_told(facts_at, capsys):
    """A worker started with --facts-port: `hostcheck --rpc --facts-port` finds its facts."""
    moved = Endpoint("127.0.0.1", facts_at.port + 1 - 100)     # its facts port is not its RPC port + 1
    server = worker_facts.serve(Endpoint("127.0.0.1", free_port()), {**WORKER, "endpoint": str(moved)})
    try:
        port = server.server_address[1]
        assert main(["hostcheck", "--rpc", str(moved), "--facts-port", str(port), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["workers"][str(moved)]["worker"]["endpoint"] == str(moved)
        assert main(["hostcheck", "--rpc", str(moved), "--json"]) == 1       # not on its RPC port + 1
        assert "error" in json.loads(capsys.readouterr().out)["workers"][str(moved)]
    finally:
        server.shutdown()
        server.server_close()
