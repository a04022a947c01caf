"""The toy MCP server (toy_server.py) as the tests reach it: a stdio command, or a process serving
streamable HTTP on a port."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.mcp.settings import ServerSpec

TOY = str(Path(__file__).with_name("toy_server.py"))


def stdio_spec(name: str = "toy", **changes) -> ServerSpec:
    return ServerSpec(name, command=sys.executable, args=(TOY, "stdio"), **changes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def toy_http(port: int):
    """A toy server on streamable HTTP at `port` while the block runs; its URL."""
    proc = subprocess.Popen([sys.executable, TOY, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, "the toy HTTP server exited"
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the toy HTTP server did not listen within 60 s")
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
