"""ToolHub against the toy MCP server (toy_server.py) over stdio and streamable HTTP: the tools
listed with their schemas, a call, a hung tool cut off by the timeout while the hub stays usable,
a huge result bounded, a tool's own error, a stdio server that dies (restarted on the next call),
servers that cannot be reached, the stdio environment, calls from many threads, and close."""
from __future__ import annotations

import os
import re
import threading

import pytest

from appliance.mcp.hub import ToolHub, model_name
from appliance.mcp.settings import STDIO_INHERITED, TOOL_NAME, ServerSpec

from .toy import free_port, stdio_spec, toy_http

TIMEOUT_S = 5.0
BOUND = 1000
TOOLS = {"add", "hang", "huge", "fail", "env", "die", "die_soon", "pid"}


@pytest.fixture(scope="module", params=["stdio", "http"])
def hub(request, toy_http_url):
    """One hub per transport, shared by the module's tests."""
    if request.param == "stdio":
        spec = stdio_spec(timeout_s=TIMEOUT_S, max_result_chars=BOUND, auto_approve=frozenset({"add"}))
    else:
        spec = ServerSpec("toy", url=toy_http_url, timeout_s=TIMEOUT_S, max_result_chars=BOUND,
                          approve_all=True)
    h = ToolHub([spec])
    h.status(wait_s=120)     # connected, however loaded the machine (listing waits 10 s by default)
    yield h
    h.close()


def test_lists_the_tools_with_their_schemas(hub):
    [server] = hub.status()
    assert server.state == "ready" and server.error is None, server
    tools = {t.tool: t for t in hub.tools()}
    assert set(tools) == TOOLS
    add = tools["add"]
    assert add.name == "toy__add" and add.server == "toy" and add.description == "Add two numbers."
    assert add.input_schema["type"] == "object" and set(add.input_schema["required"]) == {"a", "b"}
    assert add.input_schema["properties"]["a"]["type"] == "number"
    assert add.auto_approve
    # stdio approves add only; http approves every tool
    assert tools["hang"].auto_approve == (server.transport == "http")


def test_a_call_returns_the_tools_answer(hub):
    r = hub.call("toy__add", {"a": 2, "b": 40})
    assert (r.ok, r.text, r.truncated, r.error) == (True, "42", False, None)
    assert r.seconds >= 0


def test_a_hung_tool_is_cut_off_and_the_hub_stays_usable(hub):
    r = hub.call("toy__hang", {})
    assert not r.ok and r.error == f"timed out after {TIMEOUT_S:g} s"
    assert TIMEOUT_S <= r.seconds < TIMEOUT_S + 5
    assert hub.call("toy__add", {"a": 1, "b": 1}).text == "2"


def test_a_huge_result_is_bounded_and_says_so(hub):
    r = hub.call("toy__huge", {"n": 50_000})
    assert r.ok and r.truncated and r.text == "x" * BOUND
    small = hub.call("toy__huge", {"n": 10})
    assert small.text == "x" * 10 and not small.truncated


def test_the_tools_own_failure_is_a_result(hub):
    r = hub.call("toy__fail", {})
    assert not r.ok and r.error == "the tool reported an error" and "fail" in r.text


def test_bad_arguments_and_unknown_tools_are_results(hub):
    bad = hub.call("toy__add", {"a": "many"})
    assert not bad.ok and bad.error
    unknown = hub.call("toy__nope", {})
    assert not unknown.ok and "no tool 'toy__nope'" in unknown.error
    other = hub.call("elsewhere__add", {})
    assert not other.ok and "no configured MCP server" in other.error
    assert not hub.call("toy__add", ["not", "an", "object"]).ok


def test_calls_from_many_threads_at_once(hub):
    results = {}

    def run(i: int) -> None:
        results[i] = hub.call("toy__add", {"a": i, "b": 1000})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: r.text for i, r in results.items()} == {i: str(i + 1000) for i in range(8)}


def test_a_stdio_server_that_dies_starts_again():
    h = ToolHub([stdio_spec(timeout_s=10)])
    try:
        first = int(h.call("toy__pid", {}).text)
        assert h.call("toy__die_soon", {}).text == "bye"   # exits 0.2 s after answering
        _gone(first)
        # found dead before the call: started again, and the call runs
        assert h.call("toy__add", {"a": 1, "b": 2}).text == "3"
        second = int(h.call("toy__pid", {}).text)
        assert second != first
        died = h.call("toy__die", {})                        # dies during the call: reported
        assert not died.ok and "closed during the call" in died.error
        assert h.call("toy__add", {"a": 2, "b": 2}).text == "4"
        assert h.status()[0].state == "ready"
    finally:
        h.close()


def _gone(pid: int, wait_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_servers_that_cannot_be_reached_are_reported_and_the_others_serve(toy_http_url):
    port = int(re.search(r":(\d+)/", toy_http_url).group(1))
    specs = [ServerSpec("missing", command="/nonexistent/mcp-server", timeout_s=3),
             ServerSpec("closed", url="http://127.0.0.1:9/mcp", timeout_s=3),
             ServerSpec("notmcp", url=f"http://127.0.0.1:{port}/elsewhere", timeout_s=3),
             ServerSpec("toy", url=toy_http_url, timeout_s=3)]
    h = ToolHub(specs)
    try:
        status = {s.name: s for s in h.status(wait_s=120)}
        for name in ("missing", "closed", "notmcp"):
            assert status[name].state == "failed" and status[name].error and not status[name].tools, status[name]
        assert "No such file" in status["missing"].error
        assert status["toy"].state == "ready"
        assert {t.server for t in h.tools()} == {"toy"}
        r = h.call("missing__anything", {})
        assert not r.ok and r.error.startswith("server missing is unavailable")
        assert h.call("toy__add", {"a": 3, "b": 4}).text == "7"
    finally:
        h.close()


def test_a_server_that_failed_is_tried_again_when_the_tools_are_listed_later(monkeypatch):
    from appliance.mcp import hub as hub_module

    port = free_port()
    h = ToolHub([ServerSpec("late", url=f"http://127.0.0.1:{port}/mcp", timeout_s=3)])
    try:
        assert h.status()[0].state == "failed" and h.tools() == []
        with toy_http(port):
            assert h.status()[0].state == "failed"           # not before RETRY_S
            monkeypatch.setattr(hub_module, "RETRY_S", 0.0)
            assert h.status(wait_s=120)[0].state == "ready"
            assert h.call("late__add", {"a": 1, "b": 2}).text == "3"
    finally:
        h.close()


def test_a_stdio_server_gets_the_configured_environment_only(monkeypatch):
    monkeypatch.setenv("APPLIANCE_API_KEY", "not-for-tools")
    h = ToolHub([stdio_spec(env=(("TOY_GREETING", "hello"),), timeout_s=10)])
    try:
        greeting, names = h.call("toy__env", {}).text.split("|")
        assert greeting == "hello"
        # LC_CTYPE: Python sets it in the child itself (PEP 538), it is not passed on
        assert set(names.split(",")) - {"LC_CTYPE"} <= set(STDIO_INHERITED) | {"TOY_GREETING"}
    finally:
        h.close()


def test_close_stops_the_stdio_server_and_later_calls_say_so():
    h = ToolHub([stdio_spec(timeout_s=10)])
    pid = int(h.call("toy__pid", {}).text)
    h.close()
    _gone(pid)
    r = h.call("toy__add", {"a": 1, "b": 1})
    assert not r.ok and r.error == "the tool hub is closed"
    h.close()   # twice is harmless


def test_model_names_are_function_names_unique_and_stable():
    assert model_name("files", "read_file") == "files__read_file"
    assert model_name("web", "fetch.page v2") == "web__fetch_page_v2"
    long_a, long_b = model_name("s", "a" * 80), model_name("s", "a" * 79 + "b")
    assert len(long_a) == 64 and TOOL_NAME.match(long_a) and long_a != long_b
    assert long_a == model_name("s", "a" * 80)
