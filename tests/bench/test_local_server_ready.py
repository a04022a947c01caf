"""A server `bench` and `sweep` start is measured once it is ready to be measured: /health
answers, and a torch engine's first start on a machine has moved to its CPU kernels (it
serves on torch ops while they build, `cpu_kernels` "building")."""
from __future__ import annotations

import pytest

from appliance.bench import client


class Answer:
    def __init__(self, status: int, body) -> None:
        self.status_code, self.body = status, body

    def json(self):
        if self.body is None:
            raise ValueError("not JSON")
        return self.body


class Running:
    def poll(self):
        return None


def waiting_server(monkeypatch, answers: list) -> list:
    asked = []

    def get(url, timeout):
        asked.append(url)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(client.requests, "get", get)
    monkeypatch.setattr(client.time, "sleep", lambda s: None)
    return asked


def server() -> client.LocalServer:
    s = object.__new__(client.LocalServer)
    s.proc, s.url = Running(), "http://127.0.0.1:1"
    return s


def test_ready_waits_for_the_move_to_the_cpu_kernels(monkeypatch):
    asked = waiting_server(monkeypatch, [
        client.requests.ConnectionError("refused"),
        Answer(503, {"status": "loading"}),
        Answer(200, {"status": "ok", "settings": {"cpu_kernels": "building"}}),
        Answer(200, {"status": "ok", "settings": {"cpu_kernels": "building"}}),
        Answer(200, {"status": "ok", "settings": {"cpu_kernels": "cpp"}}),
    ])
    server()._wait_healthy(60)
    assert len(asked) == 5


@pytest.mark.parametrize("body", [{"status": "ok", "settings": {"cpu_kernels": "ops"}},
                                  {"status": "ok"},                      # another server's /health
                                  {"status": "ok", "settings": {"engine": "llamacpp"}}])
def test_a_server_without_a_build_is_ready_at_once(monkeypatch, body):
    asked = waiting_server(monkeypatch, [Answer(200, body)])
    server()._wait_healthy(60)
    assert len(asked) == 1


def test_a_server_the_bench_started_stops_when_the_bench_is_killed(tmp_path):
    """kill -9 of the bench (or a caller's timeout) leaves no server spinning on the cores: the
    server's process gets SIGTERM when its parent dies, as LocalServer starts it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    bench = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from appliance.bench.client import _stop_with_parent\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=_stop_with_parent)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    server = int(bench.stdout.readline())
    os.kill(bench.pid, signal.SIGKILL)
    bench.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break          # gone (reaped by init once it stopped)
        with open(f"/proc/{server}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break      # stopped, not yet reaped
        time.sleep(0.05)
    else:
        os.kill(server, signal.SIGKILL)
        raise AssertionError("the server outlived the bench that started it")
