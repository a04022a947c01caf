"""Replies the server owns, in a real browser (headless Chromium): a tab closed mid-reply and
reopened finds the reply finished, a second tab follows a reply mid-stream and stops it, a server
killed mid-reply keeps the partial reply marked cut off (on the embedded model); and a tool call's
approve / deny / hung tool, on the scripted model with a fake ToolHub."""
from __future__ import annotations

import contextlib
import time

import psutil
import pytest
import requests

from .browser import browser_page, needs_browser
from .conftest import running_server
from .fake_tools import FakeHub, director
from .scripted_engine import ScriptedEngine, ScriptedPool, model, serve

pytestmark = needs_browser
STORY = "Write a long story about a lighthouse keeper."
GROWING = "(document.querySelector('.msg.assistant .content')?.textContent || '').length > 20"
# a good neighbour on a busy machine, and no start-up checks these tests do not need
QUIET = ("--n-ctx", "2048", "--thread-wait", "passive", "--speculate", "off", "--prompt-cache", "off")
SLOW_MS = 600_000    # a reply on a machine shared with other test runs


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ui-jobs"), *QUIET, "--n-slots", "2") as srv:
        yield srv


def long_reply(page, max_tokens: int) -> str:
    """Ask for a story of up to `max_tokens` and wait for its first words; the conversation's id."""
    page.click("#settings summary")
    page.fill("#max_tokens", str(max_tokens))
    page.locator("#max_tokens").dispatch_event("change")
    page.click("#settings summary")
    page.fill("#input", STORY)
    page.keyboard.press("Enter")
    page.wait_for_function(GROWING)
    return page.evaluate("location.hash.slice(1)")


def job_of(url: str, conv_id: str) -> dict:
    return requests.get(f"{url}/api/conversations/{conv_id}/job", timeout=10).json()


def stored(url: str, conv_id: str) -> list[dict]:
    return requests.get(f"{url}/api/conversations/{conv_id}", timeout=10).json()["messages"]


def test_a_tab_closed_mid_reply_finds_it_finished_when_reopened(server):
    with browser_page(server, "jobs-closed-tab") as page:
        page.goto(server.url + "/")
        conv_id = long_reply(page, 96)
        assert job_of(server.url, conv_id)["state"] == "running"
    # the tab is gone: the server goes on alone; a new one follows the reply to its end
    time.sleep(1)
    with browser_page(server, "jobs-reopened", timeout_ms=SLOW_MS) as page:
        page.goto(f"{server.url}/#{conv_id}")
        page.wait_for_selector(".turn.assistant .stats")
        page.wait_for_selector("#send:not([disabled])")
        reply = stored(server.url, conv_id)[1]
        assert reply["finish_reason"] in ("stop", "length") and reply["timings"]["predicted_n"] > 5
        assert job_of(server.url, conv_id)["state"] == "done"
        shown = page.locator(".msg.assistant .content").inner_text().split()
        assert shown[:5] == reply["content"].split()[:5] and len(shown) > 5
        assert not page.console, page.console


def test_a_second_tab_follows_the_reply_mid_stream_and_stops_it(server):
    with browser_page(server, "jobs-two-tabs", timeout_ms=SLOW_MS) as page:
        page.goto(server.url + "/")
        conv_id = long_reply(page, 1500)
        other = page.context.new_page()
        other.set_default_timeout(SLOW_MS)
        other.goto(f"{server.url}/#{conv_id}")
        other.wait_for_function(GROWING)
        seen = len(other.locator(".msg.assistant .content").inner_text())
        other.wait_for_function(f"document.querySelector('.msg.assistant .content').textContent.length > {seen + 10}")
        assert other.locator("#stop:not([disabled])").count() == 1     # live there too: it can stop it
        other.click("#stop")
        for p in (page, other):
            p.wait_for_selector(".turn.assistant .note")
            p.wait_for_selector("#send:not([disabled])")
            assert p.locator(".turn.assistant .note").inner_text() == "stopped"
        assert page.locator(".msg.assistant .content").inner_text() == other.locator(".msg.assistant .content").inner_text()
        reply = stored(server.url, conv_id)[1]
        assert reply["finish_reason"] == "cancelled" and job_of(server.url, conv_id)["state"] == "stopped"
        assert not page.console, page.console


def _kill(srv) -> None:
    """A crash: the server and its engine processes killed, no shutdown."""
    procs = [srv.proc, *(psutil.Process(srv.proc.pid).children(recursive=True))]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.kill()
    srv.proc.wait(10)


def test_a_server_killed_mid_reply_keeps_it_cut_off(tmp_path):
    db = str(tmp_path / "kept.db")
    args = (*QUIET, "--n-slots", "1", "--conversations-db", db)
    with running_server(tmp_path, *args) as srv, browser_page(srv, "jobs-killed", timeout_ms=SLOW_MS) as page:
        page.goto(srv.url + "/")
        conv_id = long_reply(page, 1500)
        deadline = time.monotonic() + 120
        while len(stored(srv.url, conv_id)) < 2 or not stored(srv.url, conv_id)[1]["content"]:
            assert time.monotonic() < deadline     # the reply is written as it grows (each second)
            time.sleep(0.2)
        _kill(srv)
    with running_server(tmp_path, *args) as srv, browser_page(srv, "jobs-restarted") as page:
        reply = stored(srv.url, conv_id)[1]
        assert reply["finish_reason"] == "cut_off" and reply["content"]
        assert job_of(srv.url, conv_id)["state"] == "cut_off"
        page.goto(f"{srv.url}/#{conv_id}")
        page.wait_for_selector(".turn.assistant .note.cutoff")
        assert page.locator(".msg.assistant .content").inner_text().strip()
        assert page.locator(".turn.assistant .continue").count() == 1      # it can be continued
        assert not page.console, page.console


# -- tools, on the scripted model -------------------------------------------------------------------
class Scripted:
    """The app over the scripted model and a fake ToolHub on a socket, as running_server's."""

    def __init__(self, url: str, app) -> None:
        self.url, self.app = url, app

    def log(self) -> str:
        return ""


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from appliance.config import Config, ServerConfig
    from web import create_app

    tmp = tmp_path_factory.mktemp("ui-tools")
    engine = ScriptedEngine(model("Qwen3-Coder", str(tmp)), director=director)
    app = create_app(Config(server=ServerConfig(conversations_db=str(tmp / "c.db"))), ScriptedPool(engine))
    hub = app.extensions["appliance.tools"] = FakeHub(timeout_s=1.0)
    with serve(app) as url:
        yield Scripted(url, app)
    hub.release.set()


def with_tools(srv, tools: list[str]) -> str:
    conv = requests.post(srv.url + "/api/conversations", json={"title": "tools"}, timeout=10).json()
    srv.app.extensions["appliance.conversations"].get().update(conv["id"], settings={"tools": tools})
    return conv["id"]


@pytest.mark.parametrize("tool,decision,result", [
    ("add", "approve", "5"), ("add", "deny", "denied by the user"), ("hang", "approve", "error: timed out after 1 s")])
def test_a_tool_call_waits_for_the_decision_and_its_result_goes_back(scripted, tool, decision, result):
    conv_id = with_tools(scripted, [tool])
    with browser_page(scripted, f"jobs-tool-{tool}-{decision}") as page:
        page.goto(f"{scripted.url}/#{conv_id}")
        page.wait_for_selector("#input")
        page.fill("#input", "Use the tool.")
        page.keyboard.press("Enter")
        page.wait_for_selector(f".toolcall .decision button.{decision}")
        assert page.locator(".toolcall .label").inner_text().startswith(f"tool call · {tool}")
        page.reload()                                   # the wait survives a reload
        page.click(f".toolcall .decision button.{decision}")
        page.wait_for_selector(".msg.tool pre")
        page.wait_for_selector("#send:not([disabled])")
        assert page.locator(".msg.tool pre").inner_text() == result
        assert page.locator(".msg.assistant .content").last.inner_text() == f"Result: {result}"
        assert not page.console, page.console
