"""The benchmarks page in headless Chromium against a real server whose result store holds a run
made by a real (tiny) `appliance sweep` in this module, and a second run written through Store:
the runs table, a run's conditions, tables and uPlot curves, two runs compared, the estimate,
and a phone-width layout. One sweep and one server for the module."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from appliance.bench import results
from appliance.store import RunStatus, Store

from .browser import browser_page, needs_browser
from .conftest import running_server
from .test_bench_api import store_run, sweep_cells

pytestmark = needs_browser
SIZES = (32, 64)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """Run 1: `appliance sweep` for real, two prompt sizes, served and raw; run 2: the same cells
    at twice the rates, written through Store."""
    tmp = tmp_path_factory.mktemp("bench-ui")
    path = tmp / "results.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "APPLIANCE_PLAN": "off", "APPLIANCE_CACHE_DIR": str(tmp / "cache")}
    out = subprocess.run([sys.executable, "-m", "appliance", "sweep", "-p", ",".join(map(str, SIZES)), "-n", "6",
                          "--runs", "1", "--n-ctx", "256", "--n-slots", "1", "--quiet", "--db-path", str(path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr + out.stdout
    with Store.open(path) as store:
        (run,) = store.runs()
        assert run.kind == "sweep" and run.status is RunStatus.COMPLETE
    store_run(path, sweep_cells(scale=2.0, repeats=1, sizes=SIZES))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, db):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPLIANCE_DB_PATH", str(db))
        with running_server(tmp_path_factory.mktemp("bench-ui-server"), "--n-ctx", "256", "--n-slots", "1") as srv:
            yield srv


def errors(page) -> list[str]:
    return [m for m in page.console if m.startswith(("error", "pageerror"))]


def canvas_drawn(page, selector: str) -> list[int]:
    """Opaque pixels on each canvas matching `selector`: uPlot has drawn lines, points and axes."""
    return page.eval_on_selector_all(selector, """cs => cs.map(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })""")


def rate(x: float) -> str:
    return f"{x:,.1f}"


def test_the_swept_run_shows_its_conditions_tables_and_curves(server, db):
    with Store.open(db) as store:
        info, cells = store.run(1), store.results(1)
    with browser_page(server, "bench-run") as page:
        page.goto(server.url + "/bench")
        page.wait_for_selector("#runs tr.run")
        rows = page.locator("#runs tr.run")
        assert [rows.nth(i).get_attribute("data-id") for i in range(rows.count())] == ["2", "1"]   # newest first
        first = page.locator("#runs tr.run[data-id='1']")
        text = first.inner_text()
        assert "sweep -p 32,64" in text and "SmolLM2-135M-Instruct.Q4_1.gguf" in text and "complete" in text
        first.locator("td").nth(3).click()
        page.wait_for_selector("#run .chart canvas")
        assert page.get_attribute("#run", "data-run") == "1"
        assert page.locator("#run .chart").count() == 3
        assert all(n > 500 for n in canvas_drawn(page, "#run .chart canvas"))
        conditions = page.inner_text("#run .card")
        assert f"n_ctx {info.engine_settings['n_ctx']}" in conditions and "threads" in conditions
        assert "sha256 " + info.model.sha256[:12] in conditions
        # the curve's legend names served and raw; the tables hold the run's own medians
        legend = page.inner_text("#run .chart >> nth=0")
        assert "served" in legend and "raw" in legend and "context depth (tokens)" in legend
        table = page.inner_text("#run table.rows")
        for row in results.rows(cells):
            assert rate(row.prefill_tps.median) in table and rate(row.client_decode_tps.median) in table
        assert "client decode (tok/s)" in table and "prompt (tokens)" in table
        assert page.locator("#run table.ratios").count() == 1          # served against raw
        # without a power reader (the development VM) the page says why instead of a tokens-per-joule figure
        measured = any(c.request_j is not None for c in cells)
        assert ("Tokens per joule (tok/J) are gross" if measured
                else f"Energy (tok/J): unavailable ({cells[0].energy_note}).") in page.inner_text("#run")
        assert "energy (J)" in conditions and "decode (tok/J)" in table
        assert errors(page) == []


def test_two_runs_compared_overlay_their_curves_and_give_the_pairwise_ratios(server, db):
    with Store.open(db) as store:
        expected = results.compare(store.results(1), store.results(2))
    with browser_page(server, "bench-compare") as page:
        page.goto(server.url + "/bench")
        page.wait_for_selector("#runs tr.run")
        assert page.is_disabled("#compare")
        page.check("#runs tr.run[data-id='1'] input[name=a]")
        page.check("#runs tr.run[data-id='2'] input[name=b]")
        page.click("#compare")
        page.wait_for_selector("#comparison .chart canvas")
        assert page.locator("#comparison .chart").count() == 2
        assert all(n > 500 for n in canvas_drawn(page, "#comparison .chart canvas"))
        assert "run 1 served" in page.inner_text("#comparison .chart >> nth=0")
        ratios = page.locator("#comparison table.ratios tbody tr")
        assert ratios.count() == len(expected) == 2 * len(SIZES)     # served and raw, each size
        text = page.inner_text("#comparison table.ratios")
        for row in expected:
            r = row.client_decode_tps.ratio
            assert f"({'+' if r >= 1 else ''}{(r - 1) * 100:,.1f}%)" in text
        assert not page.locator("#run .chart").count()                 # compare does not open a run
        assert errors(page) == []


def test_the_estimate_form_answers_from_the_stored_curves(server, db):
    with Store.open(db) as store:
        expected = results.estimate_from_store(store, 48, 20)
    with browser_page(server, "bench-estimate") as page:
        page.goto(server.url + "/bench")
        page.fill("#estimate input[name=prompt_tokens]", "48")
        page.fill("#estimate input[name=output_tokens]", "20")
        page.click("#estimate button[type=submit]")
        page.wait_for_selector("#estimateout strong")
        text = page.inner_text("#estimateout")
        assert f"from the curves of run {expected.source_run}".lower() in text.lower()
        assert rate(expected.prefill_tps) in text and "tok/s" in text and "n_ctx" in text
        page.fill("#estimate input[name=run_id]", "99")
        page.click("#estimate button[type=submit]")
        page.wait_for_selector("#estimateout .error")
        assert "no run with id 99" in page.inner_text("#estimateout")
        assert [m for m in errors(page) if "404" not in m] == []    # the refused request is logged


def test_phone_width_has_no_page_wide_scroll(server):
    with browser_page(server, "bench-phone", viewport={"width": 390, "height": 800}) as page:
        page.goto(server.url + "/bench")
        page.wait_for_selector("#runs tr.run")
        page.locator("#runs tr.run[data-id='1'] td").nth(2).click()
        page.wait_for_selector("#run .chart canvas")
        widths = page.evaluate("""() => [document.documentElement.scrollWidth, window.innerWidth,
            Math.max(...[...document.querySelectorAll('#run .chart')].map(c => c.getBoundingClientRect().right))]""")
        assert widths[0] <= widths[1] and widths[2] <= widths[1], widths
        assert errors(page) == []
