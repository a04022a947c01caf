"""The MCP tools in a real server and a real browser: `serve` with a toy MCP server from
settings.toml (stdio, tests/mcp/toy_server.py) and a broken one from --mcp; /api/tools and a call
through the served app; the page's tools panel (the servers, their state and tools, which run
unasked) and a conversation's choice of tools, stored in its settings and shown again after a
reload; and the stdio server stopped with the appliance (the fixture's teardown checks it)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import requests

from ..mcp.toy import TOY
from .browser import browser_page, needs_browser
from .conftest import running_server, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-ui")
    library = d / "library"
    library.mkdir()
    (library / "settings.toml").write_text(
        f"[mcp.servers.toy]\ncommand = {json.dumps(sys.executable)}\nargs = [{json.dumps(TOY)}, \"stdio\"]\n"
        "auto_approve = [\"add\"]\ntimeout_s = 5\n")
    with running_server(d, "--n-ctx", "512", "--n-slots", "1", "--library", str(library),
                        "--mcp", "broken=/nonexistent/mcp-server", timeout=400) as srv:
        # connected (on a loaded machine a stdio server may take longer than /api/tools waits)
        assert wait_until(lambda: _state(srv, "toy") == "ready", timeout=120, interval=0.5)
        pid = int(requests.post(srv.url + "/api/tools/call", json={"name": "toy__pid"}, timeout=60).json()["text"])
        assert _alive(pid)
        yield srv
    # stopping the appliance stops its stdio servers
    assert wait_until(lambda: not _alive(pid), timeout=15), f"the toy MCP server {pid} outlived the appliance"
    assert "stopped" in srv.log()


def stored_tools(server, cid: str) -> list[str]:
    return requests.get(f"{server.url}/api/conversations/{cid}", timeout=10).json()["settings"]["tools"]


def test_serve_lists_and_runs_the_configured_servers_tools(server):
    body = requests.get(server.url + "/api/tools", timeout=60).json()
    servers = {s["name"]: s for s in body["servers"]}
    assert servers["toy"]["state"] == "ready" and servers["broken"]["state"] == "failed"
    assert {t["name"] for t in servers["toy"]["tools"]} >= {"toy__add", "toy__hang"}
    r = requests.post(server.url + "/api/tools/call", json={"name": "toy__add", "arguments": {"a": 20, "b": 22}},
                      timeout=60).json()
    assert (r["ok"], r["text"]) == (True, "42")
    hung = requests.post(server.url + "/api/tools/call", json={"name": "toy__hang"}, timeout=60).json()
    assert hung["error"] == "timed out after 5 s"
    assert "MCP servers: toy (stdio), broken (stdio)" in server.log()


@needs_browser
def test_the_tools_panel_lists_the_servers_and_a_conversation_chooses_tools(server):
    cid = requests.post(server.url + "/api/conversations", json={"title": "with tools"}, timeout=10).json()["id"]
    with browser_page(server, "chat-tools-panel") as page:
        page.goto(f"{server.url}/#{cid}")
        page.wait_for_selector("#tools-panel:not([hidden])")
        page.click("#tools-panel summary")
        add, hang = page.locator('[data-tool="toy__add"]'), page.locator('[data-tool="toy__hang"]')
        add.wait_for()
        assert "runs unasked" in add.inner_text() and not hang.locator(".tool-badge").count()
        assert "toy__add" not in add.inner_text() and add.locator("code").inner_text() == "add"
        assert "stdio · ready" in page.locator('[data-server="toy"] legend').inner_text()
        assert "No such file" in page.locator('[data-server="broken"] .tool-error').inner_text()
        assert page.locator("#tools-summary").inner_text() == "none chosen"
        add.locator("input").check()
        page.locator('[data-tool="toy__huge"] input').check()
        assert wait_until(lambda: stored_tools(server, cid) == ["toy__add", "toy__huge"], timeout=10)
        assert page.locator("#tools-summary").inner_text() == "2 chosen"
        page.reload()                                            # shown again from the stored settings
        page.wait_for_selector('[data-tool="toy__add"] input:checked', state="attached")
        assert page.locator("#tools-list input:checked").count() == 2
        page.click("#tools-panel summary")
        page.locator('[data-tool="toy__add"] input').uncheck()
        assert wait_until(lambda: stored_tools(server, cid) == ["toy__huge"], timeout=10)
        assert page.console == []


def _state(server, name: str) -> str | None:
    servers = requests.get(server.url + "/api/tools", timeout=60).json()["servers"]
    return next((s["state"] for s in servers if s["name"] == name), None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
