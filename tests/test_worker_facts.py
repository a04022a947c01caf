"""A worker's host facts (issue 52): served on the port after its RPC port, printed by
`appliance hostcheck --rpc`, stored by bench beside a split and shown in the run's report. These
run anywhere (no RPC build): the facts server is started here as `appliance worker` starts it;
tests/engine/test_rpc.py checks a real worker answers."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
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
