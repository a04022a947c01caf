"""`--restart-command`: how an agent replay restarts a server it did not start (llama-server
behind --url), then waits for it to answer again; and how a server lost mid-run is named."""
from __future__ import annotations

import http.server
import threading

import pytest

from appliance.bench.client import BenchError, ServerGone, Target, free_port


class Models(http.server.BaseHTTPRequestHandler):
    """A stand-in server whose /v1/models answers only once `up` is set."""

    up = threading.Event()

    def do_GET(self):  # noqa: N802 - the handler's name
        ok = self.path == "/v1/models" and self.up.is_set()
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b'{"object": "list", "data": []}' if ok else b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Models.up.clear()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_the_command_runs_then_the_bench_waits_until_the_server_answers(server, tmp_path):
    marker = tmp_path / "restarted"
    target = Target(server)
    threading.Timer(1.0, Models.up.set).start()     # the server comes back a second later
    target.restart_with(f"touch {marker}", timeout=30)
    assert marker.exists() and Models.up.is_set()


def test_a_failing_command_or_a_server_that_never_returns_is_a_clear_error(server):
    target = Target(server)
    with pytest.raises(BenchError, match="exited with code 3"):
        target.restart_with("exit 3", timeout=30)
    with pytest.raises(BenchError, match="did not answer within 2 s"):
        target.restart_with("true", timeout=2)


class Closing(http.server.BaseHTTPRequestHandler):
    """Answers every other request; the others get their connection closed unanswered (as
    llama-server's HTTP library closes a kept-alive connection after a few requests)."""

    protocol_version = "HTTP/1.1"
    seen = 0

    def do_GET(self):  # noqa: N802
        Closing.seen += 1
        if Closing.seen % 2 == 0:
            self.close_connection = True
            return
        body = b'{"object": "list", "data": [{"id": "m"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_connection_closed_unanswered_is_sent_again_once():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        target = Target(f"http://127.0.0.1:{srv.server_address[1]}")
        assert [target.model_ids() for _ in range(3)] == [["m"]] * 3
        assert Closing.seen == 5      # the second and the fourth were closed unanswered, and sent again
    finally:
        srv.shutdown()


def test_a_server_gone_mid_run_reads_the_same_whichever_request_finds_it():
    target = Target(f"http://127.0.0.1:{free_port()}")     # nothing listens there
    calls = [lambda: target.tokenize("Hello"), lambda: target.detokenize([1, 2]),
             lambda: target.stream("/v1/completions", {"prompt": "x"})]
    for call in calls:
        with pytest.raises(ServerGone, match="stopped answering"):
            call()
