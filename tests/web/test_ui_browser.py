"""The chat page in a real browser (headless Chromium driven by Playwright): two turns, each
reply streamed, the conversation kept, and the engine's timings shown under each reply."""
from __future__ import annotations

import json
import shutil

import pytest

from .conftest import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")


def test_chat_page_streams_two_turns_and_shows_timings(tmp_path):
    with running_server(tmp_path, "--n-ctx", "1024", "--n-slots", "1") as srv, \
            playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-sync"])
        try:
            page = browser.new_page()
            page.set_default_timeout(90_000)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.goto(srv.url + "/")
            try:
                # greedy and short: a long sampled first reply could leave no room for the second
                # turn's max_tokens in a 1,024-token context (the page then shows the 400)
                page.fill("#temperature", "0")
                page.fill("#max_tokens", "64")
                page.fill("#input", "What is the capital of France?")
                page.keyboard.press("Enter")
                page.wait_for_selector(".stats")
                page.wait_for_selector("#send:not([disabled])")  # the first reply has finished
                page.fill("#input", "And of Italy?")
                page.click("#send")
                page.wait_for_function("document.querySelectorAll('.stats').length == 2")
            except playwright.Error as e:
                raise AssertionError(f"{e}\npage: {page.inner_text('body')!r}\nconsole: {console}\n"
                                     f"server log:\n{srv.log()[-3000:]}") from None
            msgs = [e.inner_text() for e in page.query_selector_all(".msg")]
            stats = page.query_selector_all(".stats")
            assert len(msgs) == 4 and msgs[0] == "What is the capital of France?"
            assert msgs[1].strip() and msgs[3].strip()
            assert not page.query_selector_all(".msg.error")
            for el in stats:
                text = el.inner_text()
                assert "TTFT" in text and "prefill" in text and "decode" in text and "context" in text
            # the second turn was sent with the first one in its context
            first, second = (json.loads(el.get_attribute("data-timings")) for el in stats)
            assert second["prompt_n"] > first["depth"]
            page.click("#clear")
            assert page.query_selector_all(".msg") == []
        finally:
            browser.close()
