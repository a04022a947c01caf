"""Headless Chromium through Playwright for the page tests: Debian's chromium (no browser
download), a page that records console messages and page errors, and on failure a screenshot
saved under test-artifacts/ (or $APPLIANCE_TEST_ARTIFACTS; with APPLIANCE_TEST_SCREENSHOTS=1, of
every page) with the page text, the console
and the server's log in the assertion message."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
ARTIFACTS = Path(os.environ.get("APPLIANCE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@contextlib.contextmanager
def browser_page(server, name: str, timeout_ms: int = 90_000, **context_args):
    """A fresh page (in its own context) on `server`; `name` names the screenshot on failure.
    Yields the page; `page.console` lists console errors and warnings and uncaught errors."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-sync"])
        try:
            context = browser.new_context(**context_args)
            page = context.new_page()
            page.set_default_timeout(timeout_ms)
            page.console = []
            page.on("console", lambda m: m.type in ("error", "warning") and page.console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: page.console.append(f"pageerror: {e}"))
            try:
                yield page
                if os.environ.get("APPLIANCE_TEST_SCREENSHOTS"):   # every page, not only a failing one
                    ARTIFACTS.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(ARTIFACTS / (re.sub(r"[^\w.-]+", "_", name) + ".png")), full_page=True)
            except (AssertionError, playwright.Error) as e:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                shot = ARTIFACTS / (re.sub(r"[^\w.-]+", "_", name) + ".png")
                with contextlib.suppress(playwright.Error):
                    page.screenshot(path=str(shot), full_page=True)
                body = ""
                with contextlib.suppress(playwright.Error):
                    body = page.inner_text("body")
                raise AssertionError(f"{e}\nscreenshot: {shot}\npage: {body!r}\nconsole: {page.console}\n"
                                     f"server log:\n{server.log()[-3000:]}") from None
        finally:
            browser.close()
