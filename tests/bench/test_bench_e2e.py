"""`appliance sweep`, `bench` and `results` for real, against the embedded model, small sizes.

These assert structure and sanity (every planned cell stored, rates positive, client decode
within a plausible factor of the engine's, raw rows beside served ones), never speed.
"""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import requests

from appliance.models import embedded_model_path
from appliance.store import RunStatus, Store

from ..engine.gguf_fixtures import write_tiny_llama
from ..web.conftest import running_server

SMALL = ["--n-ctx", "1024", "--n-slots", "2", "--quiet"]


def appliance(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return str(tmp_path_factory.mktemp("results") / "results.db")


@pytest.fixture(scope="module")
def sweep_run(db):
    # 600 tokens: more than one 512-token cache block, so the cached resend has something to reuse
    out = appliance("sweep", "-p", "64,600", "-n", "12", "--runs", "2", "--cache", "on", "--db-path", db, *SMALL)
    assert out.returncode == 0, out.stderr + out.stdout
    with Store.open(db) as s:
        info = s.last_run()
        return info, s.results(info.id), s.host(info.id), out


@pytest.fixture(scope="module")
def bench_run(db, sweep_run):
    # CI time: two short prompt sets, two streams only (one stream is what every other cell
    # measures), and a short agent: a 100-token system prompt and one tool make the first turn
    # ~440 tokens, so the third turn's ~800 still hold a 512-token block that the restart
    # restores from disk
    out = appliance("bench", "--prompts", "prose,code", "--tokens", "12", "--runs", "1", "--n-ctx", "2048",
                    "--depths", "700", "--concurrency", "2", "--agent-turns", "3", "--agent-tools", "1",
                    "--agent-system-tokens", "100", "--agent-turn-tokens", "100", "--agent-restart", "--agent-tool-ms", "50",
                    "--needle-lengths", "300,2300", "--n-slots", "2", "--quiet", "--db-path", db)
    assert out.returncode == 0, out.stderr + out.stdout
    with Store.open(db) as s:
        info = s.last_run()
        return info, s.results(info.id), out


def labels(cells, **match):
    return [c for c in cells if all((c.extra.get(k) if k == "cell" else getattr(c, k)) == v
                                    for k, v in match.items())]


def test_sweep_stores_served_and_raw_cells_for_every_size(sweep_run):
    info, cells, host, out = sweep_run
    assert info.kind == "sweep" and info.status is RunStatus.COMPLETE and info.note == ""
    assert info.command[:2] == ("appliance", "sweep") and "--cache" in info.command
    assert info.model.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(info.model.sha256) == 64
    assert info.engine_settings["n_ctx"] == 1024 and info.engine_settings["prefill_chunk"] == 512
    for size in (64, 600):
        served = labels(cells, cell=f"sweep p={size}", target="served")
        raw = labels(cells, cell=f"sweep p={size}", target="raw")
        assert len(served) == 2 and len(raw) == 2
        for c in served + raw:
            assert c.prompt_tokens == size and c.depth == size and c.generated_tokens == 12
            assert c.cached_tokens == 0 and c.prefill_tps > 0 and c.client_decode_tps > 0
        for c in served:
            # sanity, not speed: the client sees the engine's rate within a plausible factor
            assert 0.33 < c.client_decode_tps / c.engine_decode_tps < 3
            assert c.engine_prefill_tps > 0
        assert [c.repeat_index for c in served] == [0, 1]
    cached = labels(cells, cell="sweep p=600 cached")
    # the cached row reuses the prompt to the token, two left to compute (llama.cpp's default
    # attention computes any chunk of two rows as the grid's: proven at the server's start)
    assert len(cached) == 2 and all(c.cache_on and c.cached_tokens == 598 and c.prefill_tps is None
                                    for c in cached)
    assert host.snapshot["cpu"] and set(host.phases) >= {"prefill", "decode", "raw"}
    # the printed table: conditions first, then the rows, then the run id
    text = out.stdout
    assert text.index("sweep p=64") > text.index("1024")
    assert f"stored as run {info.id}" in text


def test_bench_covers_prompt_sets_depth_concurrency_agent_and_needle(bench_run):
    info, cells, out = bench_run
    assert info.kind == "bench" and info.status is RunStatus.COMPLETE
    for name in ("prose", "code"):
        (c,) = labels(cells, cell=f"prompt {name}")
        assert c.kind == "prompt" and c.prompt_set == name and c.generated_tokens == 12
        assert c.client_decode_tps > 0 and c.prefill_tps > 0
    (deep,) = labels(cells, cell="depth 700")
    # padded by a characters-per-token estimate over random filler: near the depth, recorded exactly
    assert 525 <= deep.prompt_tokens <= 875 and deep.depth == deep.prompt_tokens
    pair = labels(cells, cell="concurrency 2", target="served")
    assert len(pair) == 2 and {c.extra["stream"] for c in pair} == {0, 1}
    assert all(c.concurrency == 2 and c.extra["aggregate_tps"] > 0 for c in pair)
    assert len(labels(cells, cell="concurrency 2", target="raw")) == 2
    turns = sorted(labels(cells, cell="agent"), key=lambda c: c.extra["turn"])
    assert [c.extra["turn"] for c in turns] == [0, 1, 2]
    assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
    assert all(c.cached_tokens > 0 for c in turns[1:])        # follow-ups reuse the conversation
    assert [c.extra.get("tool_ms") for c in turns] == [None, 50, 50]   # the condition, with the cell
    # the engine's own part of each TTFT is stored with it: what it waited and what it prefilled
    for c in turns + labels(cells, kind="agent-cold"):
        assert 0 < c.extra["engine_prompt_ms"] <= c.ttft_ms and 0 <= c.extra["engine_queue_ms"] < c.ttft_ms
    colds = labels(cells, kind="agent-cold")
    assert [c.extra["turn"] for c in colds] == [1, 2] and all(c.cached_tokens == 0 for c in colds)
    # after a restart the conversation comes back from the disk tier, not recomputed
    restarted = labels(cells, kind="agent-restart")
    assert [c.extra["turn"] for c in restarted] == [3] and restarted[0].cached_tokens >= 512
    assert "Agent replay against a cold request" in out.stdout and "after restart" in out.stdout
    short, over = labels(cells, cell="needle 300"), labels(cells, cell="needle 2300")
    assert short[0].extra["status"] == 200 and short[0].extra["expected_status"] == 200
    assert over[0].extra["status"] == 400 and over[0].extra["expected_status"] == 400
    assert "needle" in out.stdout and "agent" in out.stdout


def test_results_show_list_csv_json_compare_estimate_and_plot(db, sweep_run, bench_run, tmp_path):
    sweep_info = sweep_run[0]
    listing = appliance("results", "--db-path", db)
    assert listing.returncode == 0 and str(sweep_info.id) in listing.stdout and "sweep" in listing.stdout
    as_json = appliance("results", str(sweep_info.id), "--format", "json", "--db-path", db)
    doc = json.loads(as_json.stdout)
    assert doc["run"]["id"] == sweep_info.id and doc["rows"]
    as_csv = appliance("results", str(sweep_info.id), "--format", "csv", "--db-path", db)
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert {r["cell"] for r in rows} >= {"sweep p=64", "sweep p=600"}
    est = appliance("results", "--estimate", "300", "50", "--db-path", db)
    assert est.returncode == 0 and "prefill" in est.stdout and "decode" in est.stdout, est.stderr
    cmp = appliance("results", "--compare", str(sweep_info.id), str(sweep_info.id), "--db-path", db)
    assert cmp.returncode == 0 and "sweep p=600" in cmp.stdout
    png = tmp_path / "curve.png"
    plotted = appliance("results", "--plot", str(png), "--plot-runs", str(sweep_info.id), "--db-path", db)
    if plotted.returncode == 0:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in plotted.stderr
    missing = appliance("results", "999", "--db-path", db)
    assert missing.returncode == 2 and "999" in missing.stderr


def test_url_pointing_at_nothing_is_a_clear_error_before_any_work(tmp_path):
    db = str(tmp_path / "r.db")
    out = appliance("sweep", "--url", "http://127.0.0.1:9", "-p", "64", "--db-path", db, timeout=120)
    assert out.returncode == 2 and "nothing answers at http://127.0.0.1:9" in out.stderr
    assert not os.path.exists(db) or Store.open(db).runs() == []


def test_url_serving_another_model_is_refused(tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    with running_server(tmp_path, "--model", str(tiny), "--n-ctx", "256", "--n-slots", "1") as server:
        db = str(tmp_path / "r.db")
        out = appliance("sweep", "--url", server.url, "--model", str(embedded_model_path()), "-p", "64",
                        "-n", "4", "--runs", "1", "--db-path", db, timeout=300)
    assert out.returncode == 2 and "not the claimed model" in out.stderr, out.stderr
    assert not os.path.exists(db) or Store.open(db).runs() == []


def _wait_for_cells(db: str, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(db) as conn:
                if conn.execute("SELECT count(*) FROM results").fetchone()[0] >= n:
                    return
        except sqlite3.Error:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no {n} cells stored within {timeout} s")


def _ignoring_sigint() -> None:
    """A child started as `cmd &` from a script is: SIGINT ignored. Ctrl-C must stop it anyway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sweep_until(db: str, n_cells: int, interrupt, *args: str) -> subprocess.Popen:
    """A long sweep, interrupted by `interrupt()` once n_cells are stored; returns it finished.
    It starts with SIGINT ignored, as a background job of a script would."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "sweep", "-p", "64", "-n", "8", "--runs", "50",
                             "--db-path", db, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignoring_sigint)
    try:
        _wait_for_cells(db, n_cells)
        interrupt(proc)
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc


def test_ctrl_c_keeps_every_completed_cell_and_names_the_missing_ones(tmp_path):
    db = str(tmp_path / "r.db")
    proc = _sweep_until(db, 2, lambda p: p.send_signal(signal.SIGINT), "--no-raw", *SMALL)
    stdout, stderr = proc.stdout_text, proc.stderr_text
    assert proc.returncode == 130, stderr
    with Store.open(db) as s:
        info = s.last_run()
        cells = s.results(info.id)
    assert info.status is RunStatus.INTERRUPTED and len(cells) >= 2
    assert "missing" in info.note and "sweep p=64 [served] run 50" in info.note
    assert f"stored as run {info.id}" in stdout and "interrupted" in stderr


def test_a_server_dying_mid_run_marks_the_run_failed_and_keeps_its_cells(tmp_path):
    db = str(tmp_path / "r.db")
    with running_server(tmp_path, "--n-ctx", "1024", "--n-slots", "1") as server:
        proc = _sweep_until(db, 1, lambda p: server.proc.kill(), "--url", server.url, "--quiet")
    assert proc.returncode == 1, proc.stderr_text
    with Store.open(db) as s:
        info = s.last_run()
        assert info.status is RunStatus.FAILED and s.results(info.id)
    assert "stopped answering" in info.note and "missing" in info.note


def test_ab_alternates_two_servers_and_reports_pairwise_ratios(tmp_path):
    db = str(tmp_path / "r.db")
    out = appliance("sweep", "-p", "64", "-n", "8", "--runs", "2", "--ab", "--n-ubatch 256", "--n-ubatch 512",
                    "--db-path", db, *SMALL)
    assert out.returncode == 0, out.stderr + out.stdout
    with Store.open(db) as s:
        info = s.last_run()
        cells = s.results(info.id)
    # A B A B, no raw row (it has one setting), each side's settings stored
    assert [(c.variant, c.repeat_index) for c in cells] == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert all(c.target == "served" for c in cells)
    assert info.engine_settings["A"]["n_ubatch"] == 256 and info.engine_settings["B"]["n_ubatch"] == 512
    assert "A/B: B against A" in out.stdout


def test_against_another_server_alternates_the_agent_replay_turn_by_turn(tmp_path):
    # B: another appliance behind a URL (as llama-server would be); A: the one the bench starts
    db = str(tmp_path / "r.db")
    # a tiny model on both sides: the order of the replay, the settling and the labels are what is
    # proven here, not what a model says (CI time: 38 s with the embedded model)
    tiny = str(write_tiny_llama(tmp_path / "tiny.gguf", n_ctx=2048))
    with running_server(tmp_path, "--model", tiny, "--n-ctx", "2048", "--n-slots", "2") as other:
        # read_file alone: a first turn of ~400 tokens where the six tools make ~1,100
        out = appliance("bench", "--model", tiny, "--prompts", "", "--concurrency", "", "--no-depth", "--no-needle",
                        "--tokens", "4", "--agent-conversations", "2", "--agent-turns", "2",
                        "--agent-system-tokens", "100", "--agent-tools", "1",
                        "--agent-turn-tokens", "60", "--against", other.url, "--n-ctx", "2048", "--n-slots", "2",
                        "--quiet", "--db-path", db, timeout=600)
        assert out.returncode == 0, out.stderr + out.stdout
        metrics = requests.get(other.url + "/metrics", timeout=10).text
    with Store.open(db) as s:
        info = s.last_run()
        cells = s.results(info.id)
    replay = [(c.variant, c.extra["conversation"], c.extra["turn"]) for c in cells if c.kind == "agent"]
    # one step of each side at a time, A B then B A
    assert replay == [("A", 0, 0), ("B", 0, 0), ("B", 1, 0), ("A", 1, 0),
                      ("A", 0, 1), ("B", 0, 1), ("B", 1, 1), ("A", 1, 1)]
    assert [(c.variant, c.extra["turn"]) for c in cells if c.kind == "agent-cold"] == [("A", 1), ("B", 1)]
    assert max(c.prompt_tokens for c in cells if c.kind == "agent" and c.extra["turn"] == 0) < 600  # one tool
    assert info.engine_settings["B"]["url"] == other.url and info.engine_settings["A"]["url"] != other.url
    assert "B against A" in out.stdout and "server B: the server at " + other.url in out.stderr
    # each B step ended once B had nothing left to do idle: its replies were settled meanwhile
    gauges = dict(line.split() for line in metrics.splitlines() if line.startswith("appliance_prompt_cache_"))
    assert float(gauges["appliance_prompt_cache_settled_tokens_total"]) > 0
    assert float(gauges["appliance_prompt_cache_unsettled_tokens"]) == 0
