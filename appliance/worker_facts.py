"""A worker's host facts for the head (issue 52). llama.cpp's RPC protocol carries a device's
memory and nothing of the machine, so `appliance worker` also answers `GET /hostcheck` on its
facts port (the port after its RPC port unless `--facts-port` says otherwise: 50053 beside the
default 50052) with what `appliance hostcheck --json` prints on that machine (CPU, clocks,
governor, kernel command line, IOMMU, power limits, GPUs, its llama.cpp build and advice), plus
what it serves. `appliance hostcheck --rpc` prints it, and a run `bench` stores beside a split
keeps every worker's facts with the head's, so a stored figure carries every machine's conditions.

The head checks that what answers is the worker it asked about (the answer names the RPC port
it serves): another program on that port, or another worker's facts, is an error naming it, not
facts of the wrong machine.

Read-only, and as unauthenticated as the RPC port beside it: it belongs on the same private link.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .endpoints import Endpoint

PATH = "/hostcheck"


def facts_endpoint(rpc: Endpoint, port: int | None = None) -> Endpoint:
    """Where a worker serving RPC at `rpc` answers for its host: `port` (its --facts-port), else
    the next port."""
    return Endpoint(rpc.host, rpc.port + 1 if port is None else port)


def report(worker: dict[str, Any], llama: Any = None) -> dict[str, Any]:
    """This host's `hostcheck --json`, its text report, and `worker` (what it serves)."""
    from hostcheck import as_json, check, collect, render

    snap = collect(power_interval_s=0.25)
    advice = check(snap, llama=llama)
    return {**as_json(snap, advice, llama), "text": render(snap, advice, llama), "worker": worker}


def serve(at: Endpoint, worker: dict[str, Any], llama: Any = None) -> ThreadingHTTPServer:
    """Answer GET /hostcheck at `at` from a daemon thread (the RPC server holds the main one);
    each answer is collected when asked, so clocks and power are the moment's."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # http.server's name
            if self.path.split("?")[0] != PATH:
                self.send_error(404, f"only {PATH} is here")
                return
            body = json.dumps(report(worker, llama)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:   # quiet: the worker's log is its RPC server's
            pass

    server = ThreadingHTTPServer((at.host, at.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-facts", daemon=True).start()
    return server


def fetch(rpc: Endpoint, timeout_s: float = 10.0, facts_port: int | None = None) -> dict[str, Any]:
    """The facts of the worker serving RPC at `rpc` (asked on `facts_port`, else the next port),
    or {"error": why} (an older worker, one started with --no-facts or whose facts port was
    taken, a firewall between): never raises for a worker that does not answer, and never
    returns what another program on that port answered as the worker's."""
    at = facts_endpoint(rpc, facts_port)
    url = f"http://{at}{PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        return {"error": f"{url} answered HTTP {e.code}, but not as the worker at {rpc}: "
                         f"another program holds that port, or the worker's facts are not served there"}
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return {"error": f"{url}: {reason}"}
    try:
        facts = json.loads(body)
    except ValueError:
        facts = None
    why = _not_the_worker(facts, rpc)
    if why is not None:
        return {"error": f"{url} answered, but not as the worker at {rpc} ({why}): another program "
                         f"holds that port, or the worker's facts are not served there"}
    return facts


def _not_the_worker(facts: Any, rpc: Endpoint) -> str | None:
    """Why an answer is not the facts of the worker serving RPC at `rpc`, or None when it is.
    Its port must be the one asked about; its host is not compared, since the head may name the
    worker otherwise (a name for its address, an address for its 0.0.0.0)."""
    worker = facts.get("worker") if isinstance(facts, dict) else None
    if not isinstance(worker, dict) or not isinstance(worker.get("endpoint"), str):
        return "not an appliance worker's facts"
    _, _, port = worker["endpoint"].rpartition(":")
    if port != str(rpc.port):
        return f"the facts of a worker serving {worker['endpoint']}"
    return None


def fetch_all(endpoints: list[Endpoint], timeout_s: float = 10.0,
              facts_port: int | None = None) -> dict[str, dict[str, Any]]:
    """Each worker's facts by its RPC address, asked together."""
    out: dict[str, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda ep=ep: out.__setitem__(str(ep), fetch(ep, timeout_s, facts_port)))
               for ep in endpoints]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {str(ep): out[str(ep)] for ep in endpoints}


def remote_endpoints(health: dict[str, Any]) -> list[Endpoint]:
    """The workers a server holds layers on, from its /health placement (an RPC device's
    description is its worker's address)."""
    from .endpoints import parse_endpoints

    devices = ((health or {}).get("placement") or {}).get("llama_devices") or []
    seen = []
    for d in devices:
        if str(d.get("name", "")).startswith("RPC") and d.get("description") not in seen:
            seen.append(d.get("description"))
    try:
        return list(parse_endpoints(",".join(seen))) if seen else []
    except ValueError:
        return []
