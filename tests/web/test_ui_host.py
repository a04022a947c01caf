"""The host page in headless Chromium against a real server serving a saved report (the Strix
Halo fixture's, `--host-report`): the summary, each warning with its fix, the facts by section
with their sources, Refresh, and a phone-width layout. One server for the module."""
from __future__ import annotations

import json

import pytest

from .browser import browser_page, needs_browser
from .conftest import running_server
from .test_host_api import STRIX_WARNINGS, write_strix_halo_report

pytestmark = needs_browser


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_strix_halo_report(tmp_path_factory.mktemp("host-report"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved):
    path, _ = saved
    with running_server(tmp_path_factory.mktemp("host-ui"), "--n-ctx", "256", "--n-slots", "1",
                        "--host-report", str(path)) as srv:
        yield srv


def errors(page) -> list[str]:
    return [m for m in page.console if m.startswith(("error", "pageerror"))]


def test_warnings_summary_and_facts(server, saved):
    _, report = saved
    with browser_page(server, "host-page") as page:
        page.goto(server.url + "/host")
        page.wait_for_selector("#host .advice")
        summary = page.inner_text("#summary")
        for part in ("AMD RYZEN AI MAX+ 395", "16 cores / 32 threads", "127.5 GiB memory",
                     "AMD GPU gfx1151 (unified memory)", "kernel 6.17.0-5-generic (Ubuntu 24.04.3 LTS)"):
            assert part in summary
        assert "Saved report strix-halo.json" in page.inner_text("#hostmeta")
        cards = page.locator("#host .advice.warn")
        assert cards.count() == 4
        for i, advice in enumerate(report["advice"]):
            text = cards.nth(i).inner_text()
            assert STRIX_WARNINGS[i] in text and advice["message"] in text and advice["fix"] in text
        assert [d.get_attribute("data-section") for d in page.query_selector_all("#host details.facts")] == [
            "cpu", "memory", "kernel", "iommu", "gpu", "power"]
        gpu = page.locator("#host details.facts[data-section=gpu]")
        assert not gpu.locator("table").first.is_visible()
        gpu.locator("summary").click()
        assert gpu.get_attribute("open") is not None
        name = gpu.locator("tr[data-fact=name]")
        assert name.is_visible() and "no product_name in sysfs for PCI id 1002:1586" in name.inner_text()
        assert "read from /sys/class/drm/card1" in gpu.locator("caption").first.inner_text()
        page.locator("#host details.facts[data-section=iommu] summary").click()
        mode = page.inner_text("#host details.facts[data-section=iommu] tr[data-fact=mode]")
        assert "passthrough" in mode and "/sys/kernel/iommu_groups/2/type, the GPU's group" in mode
        assert errors(page) == []


def test_refresh_renders_the_report_again(server, saved):
    path, report = saved
    with browser_page(server, "host-refresh") as page:
        page.goto(server.url + "/host")
        page.wait_for_selector("#host .advice")
        page.locator("#host details.facts[data-section=power] summary").click()
        changed = dict(report, advice=report["advice"][:1])
        try:
            path.write_text(json.dumps(changed))
            page.click("#refresh")
            page.wait_for_function("document.getElementById('host').dataset.renders === '2'")
        finally:
            path.write_text(json.dumps(report))
        assert page.locator("#host .advice").count() == 1
        # a section left open stays open
        assert page.get_attribute("#host details.facts[data-section=power]", "open") is not None
        assert page.is_enabled("#refresh") and errors(page) == []


def test_phone_width_has_no_sideways_scroll(server):
    with browser_page(server, "host-phone", viewport={"width": 360, "height": 740}) as page:
        page.goto(server.url + "/host")
        page.wait_for_selector("#host .advice")
        page.evaluate("document.querySelectorAll('#host details.facts').forEach((d) => d.open = true)")
        assert page.evaluate("document.documentElement.scrollWidth") <= 360
        assert errors(page) == []
