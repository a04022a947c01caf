"""Slow and silent clients against a real server: idle half-open connections past the connection
limit, a request that never finishes arriving, a reader that stops reading (issue 23).

Two servers on the embedded model: one with a small connection limit and the default (long)
timeouts, so that a normal request answered beside 200 idle sockets proves the room made at the
limit and not a timeout; one with short timeouts."""
from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from .conftest import running_server, wait_until

HALF_OPEN = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 400\r\n\r\n{\"messages\": [")


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((host, int(port)))
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except (BlockingIOError, socket.timeout):
        return False
    except OSError:
        return True


def _chat(url: str, **extra) -> requests.Response:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=20)


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("crowded"), "--n-ctx", "512", "--n-slots", "1",
                        "--max-connections", "32") as srv:
        yield srv


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("strict"), "--n-ctx", "1024", "--n-slots", "1",
                        "--request-timeout", "2", "--send-timeout", "2") as srv:
        yield srv


def test_idle_half_open_connections_do_not_lock_others_out(crowded):
    idle = []
    try:
        for _ in range(200):
            s = _connect(crowded.url)
            s.sendall(HALF_OPEN)  # a request line, headers, a little body: then silence
            idle.append(s)
        started = time.monotonic()
        r = _chat(crowded.url)  # fails with a timeout if the server stopped accepting
        answered_in = time.monotonic() - started
        assert r.status_code == 200, r.text
        # the room came from closing the quietest idle connections, well before any timeout (60 s)
        assert answered_in < 20
        assert wait_until(lambda: sum(_closed_by_peer(s) for s in idle) >= 150, timeout=10)
        assert "at the connection limit (32): closing" in crowded.log()
        # the newest ones are still open: a connection is closed only to admit another
        assert not _closed_by_peer(idle[-1])
    finally:
        for s in idle:
            s.close()
    assert _chat(crowded.url).status_code == 200


def test_a_running_request_is_never_closed_to_make_room(crowded):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 120,
            "ignore_eos": True, "stream": True}
    with requests.post(crowded.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as streaming:
        lines = streaming.iter_lines()
        next(lines)
        idle = [_connect(crowded.url) for _ in range(60)]
        try:
            for s in idle:
                s.sendall(HALF_OPEN)
            rest = [ln for ln in lines if ln]
        finally:
            for s in idle:
                s.close()
    assert rest[-1] == b"data: [DONE]"


def test_a_request_that_never_arrives_whole_gets_a_408(strict):
    s = _connect(strict.url)
    try:
        s.sendall(HALF_OPEN)
        deadline = time.monotonic() + 15
        got = b""
        while time.monotonic() < deadline:  # trickle a byte now and then: each resets no timer
            s.settimeout(0.5)
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                s.sendall(b" ")
                continue
            if not chunk:
                break
            got += chunk
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    finally:
        s.close()
    assert _chat(strict.url).status_code == 200


def _stream_request(s: socket.socket, content: str, max_tokens: int, close: bool = False) -> None:
    """Send a streamed chat request over a raw socket (whose reading the test controls)."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + (b"Connection: close\r\n" if close else b"")
              + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_a_stream_whose_client_stops_reading_is_cancelled_and_frees_its_slot(strict):
    s = _connect(strict.url, rcvbuf=4096)
    try:
        _stream_request(s, "Tell me a very long story.", 900)
        # the client reads nothing; the server must give up on it and free the slot
        assert wait_until(lambda: "read nothing for" in strict.log(), timeout=90)
        assert wait_until(lambda: strict.health()["engine"]["slots_busy"] == 0, timeout=10)
        received = b""
        s.settimeout(10)
        while chunk := s.recv(65536):
            received += chunk
    finally:
        s.close()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received  # cut off, not finished
    assert _chat(strict.url).status_code == 200  # and the slot serves the next request


def test_a_slow_but_steady_reader_gets_the_whole_stream(strict):
    s = _connect(strict.url, rcvbuf=4096)
    try:
        _stream_request(s, "Tell me a story.", 150, close=True)
        received = b""
        while chunk := s.recv(1024):  # a kilobyte at a time, slower than the engine writes
            received += chunk
            time.sleep(0.05)
    finally:
        s.close()
    # the whole chunked body: the last event, then the terminating chunk
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-200:]
