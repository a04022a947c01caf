"""A real server for the end-to-end tests: `appliance serve` in a subprocess, one per module
(`running_server`), or one per set of arguments for the whole session (`shared_server`), which
modules that only read the server share."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import requests


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp_path, *args: str, timeout: float = 180.0, health_headers: dict | None = None):
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    # the prompt cache's disk tier writes under the test's own directory, never the user's
    # and no tuned plan from the developer's data directory changes the settings under test
    env = {"APPLIANCE_CACHE_DIR": str(tmp_path / f"prompt-cache-{port}"), "APPLIANCE_PLAN": "off",
           "APPLIANCE_LIBRARY": str(tmp_path / f"library-{port}"),
           "APPLIANCE_CONVERSATIONS_DB": str(tmp_path / f"conversations-{port}.db"),
           "APPLIANCE_DB_PATH": str(tmp_path / f"results-{port}.db"),
           **os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if requests.get(server.url + "/health", timeout=2, headers=health_headers).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):    # not up yet, or slow on a loaded machine
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_until(pred, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


# the server that the API modules which only read share: the embedded model, 1,024 positions, 2 slots
SHARED = ("--n-ctx", "1024", "--n-slots", "2")


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """`shared_server(*args)`: the session's server started with `args`, started on first use and
    stopped when the session ends. For modules that only read: nothing they do may change what
    another module's tests see (no restarts, loads, signals or counters asserted)."""
    servers: dict[tuple[str, ...], Server] = {}
    with contextlib.ExitStack() as stack:
        def get(*args: str) -> Server:
            if args not in servers:
                servers[args] = stack.enter_context(running_server(tmp_path_factory.mktemp("shared"), *args))
            return servers[args]

        yield get
