"""Two servers side by side (`--ab`, `--against URL`): the agent replay alternates them step by
step, A B then B A, and each served step ends once its server has no idle work left, so what
one server does after answering never runs beside the other's measurement."""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from appliance.bench.client import Target
from appliance.cli import main
from appliance.bench.agent import _restart_steps
from appliance.bench.context import BenchOptions
from appliance.bench.plans import alternated
from appliance.bench.session import Step, Variant, waiting_idle


def step(label: str, variant: str, target: str = "served", log: list | None = None) -> Step:
    return Step(label, 0, variant, target, lambda: (log.append(label) if log is not None else None) or [])


def test_alternated_takes_one_step_of_each_side_a_b_then_b_a():
    a = [step(f"a{i}", "A") for i in range(5)]
    b = [step(f"b{i}", "B") for i in range(5)]
    assert [s.label for s in alternated([a, b])] == ["a0", "b0", "b1", "a1", "a2", "b2", "b3", "a3", "a4", "b4"]
    assert [s.label for s in alternated([a[:2]])] == ["a0", "a1"]           # one server: its order
    assert [s.label for s in alternated([a[:1], b[:3]])] == ["a0", "b0", "b1", "b2"]
    assert alternated([]) == []


class Health(http.server.BaseHTTPRequestHandler):
    """A stand-in appliance whose /health's engine statistics are read from `answers` in turn
    (the last one repeated); `asked` counts the requests."""

    answers: list = []
    asked = 0

    def do_GET(self):  # noqa: N802 - the handler's name
        if self.path == "/v1/models":
            body = {"object": "list", "data": []}
        else:
            body = Health.answers[min(Health.asked, len(Health.answers) - 1)]
            Health.asked += 1
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Health.asked = 0
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def engine(**work):
    keys = ("slots_busy", "unsettled_tokens", "unsaved_slots", "disk_queued_bytes")
    return {"status": "ok", "engine": {**{k: 0 for k in keys}, "steps": 7, **work}}


def test_wait_idle_waits_until_no_slot_is_busy_and_nothing_is_left_to_settle_or_save(server):
    # stale statistics of the request that just ended, then its reply to settle, then a state to
    # save and one being written, then nothing
    Health.answers = [engine(slots_busy=1), engine(unsettled_tokens=24), engine(unsaved_slots=2),
                      engine(disk_queued_bytes=4096), engine()]
    assert Target(server).wait_idle(timeout=30, poll_s=0.01)
    assert Health.asked == 5


def test_wait_idle_gives_up_after_its_timeout(server):
    Health.answers = [engine(unsettled_tokens=24)]
    assert not Target(server).wait_idle(timeout=0.2, poll_s=0.01)
    assert Health.asked > 1


@pytest.mark.parametrize("body", [{"status": "ok"}, {"status": "ok", "engine": {"slots_busy": 1, "steps": 3}}])
def test_a_server_that_reports_no_idle_work_is_not_waited_for(server, body):
    # llama-server's /health has no engine statistics; an older appliance's have no idle work
    Health.answers = [body]
    assert Target(server).wait_idle(timeout=30, poll_s=0.01) and Health.asked == 1


def test_with_two_servers_each_served_step_ends_once_its_server_is_idle(server):
    Health.answers = [engine(unsettled_tokens=3), engine()]
    log: list = []
    variants = [Variant("A", Target(server), "m", 0, 1, None), Variant("B", Target(server), "m", 0, 1, None)]
    steps = [step("a0", "A", log=log), step("raw", "", target="raw", log=log)]
    wrapped = waiting_idle(steps, variants)
    assert wrapped[1] is steps[1]                     # a raw step has no server to wait for
    wrapped[0].measure()
    assert log == ["a0"] and Health.asked == 2        # measured, then waited through one busy answer
    assert waiting_idle(steps[:1], variants[:1]) == steps[:1]  # one server alone: nothing runs beside it


def test_with_one_server_and_the_raw_reference_a_served_step_ends_once_the_server_is_idle(server):
    """The raw row is never measured beside the server's settling (issue 47)."""
    Health.answers = [engine(unsaved_slots=1), engine()]
    log: list = []
    variants = [Variant("", Target(server), "m", 0, 1, None)]
    steps = [step("served", "", log=log), step("raw", "", target="raw", log=log)]
    wrapped = waiting_idle(steps, variants)
    assert wrapped[1] is steps[1]
    wrapped[0].measure()
    assert log == ["served"] and Health.asked == 2


def test_the_restart_step_runs_each_servers_own_restart_command(server, tmp_path):
    Health.answers = [engine()]
    target = Target(server)
    target.restart_command = f"touch {tmp_path / 'b-restarted'}"
    v = Variant("B", target, "m", 0, 1, None)
    (restart, *turns) = _restart_steps(None, v, BenchOptions(agent_conversations=2), lambda: [])
    assert restart.label == "agent restart" and len(turns) == 2
    restart.measure()
    assert (tmp_path / "b-restarted").exists()
    target.restart_command = None
    with pytest.raises(Exception, match="--against-restart-command"):
        restart.measure()


@pytest.mark.parametrize("args, message", [
    (["bench", "--ab", "--n-ubatch 256", "--n-ubatch 512", "--against", "http://127.0.0.1:9"], "give one of them"),
    (["bench", "--soak", "1", "--against", "http://127.0.0.1:9"], "--soak measures one server"),
    (["bench", "--agent-tools", "0"], "--agent-tools must be at least 1 (the agent's turns call read_file)"),
])
def test_two_second_servers_or_a_soak_against_another_are_refused(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err
