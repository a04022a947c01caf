"""`appliance bench --soak`: the verdict's arithmetic on synthetic outcomes and readings, the
/metrics parser, and a soak of a few seconds for real against a tiny model, through the
CLI with --url, checked by what it stored and printed (structure and statuses, never speed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from appliance.bench import soakreport
from appliance.bench.soak import Sample, SoakPlan, SoakResult, Usage, parse_metrics
from appliance.bench.soakmix import BY_NAME, KINDS, NO_ANSWER, Outcome
from appliance.store import RunStatus, Store

from ..engine.gguf_fixtures import write_tiny_llama
from ..web.conftest import running_server

MIB = 2**20


def outcome(kind: str, status: int, code: str = "", ttft: float | None = None, latency: float = 100.0) -> Outcome:
    return Outcome(kind, "run", 1.0, status, code, latency, ttft)


def readings(server_rss=(100, 100, 101), server_fds=(10, 12, 12), engine_rss=(500, 600, 640),
             engine_fds=(20, 20, 20), cache=(0, 50, 90)) -> list[Sample]:
    """start, warmed and end readings (RSS in MiB), and one during the run that peaks."""
    def at(i: int, point: str) -> Sample:
        return Sample(float(i), point, {"server": Usage(server_rss[i] * MIB, server_fds[i]),
                                        "engine m": Usage(engine_rss[i] * MIB, engine_fds[i])}, cache[i] * MIB)
    during = Sample(1.5, "during", {"server": Usage(150 * MIB, 30), "engine m": Usage(700 * MIB, 21)}, 60 * MIB)
    return [at(0, "start"), at(1, "warmed"), during, at(2, "end")]


def result(outcomes, samples=None, restarts=(0, 0)) -> SoakResult:
    return SoakResult(SoakPlan(1.0), (BY_NAME["stream"], BY_NAME["bad-json"]), outcomes,
                      readings() if samples is None else samples, restarts)


def test_a_clean_soak_passes_and_reports_percentiles_and_resources():
    ttfts = [float(t) for t in range(1, 101)]
    found = [outcome("stream", 200, ttft=t) for t in ttfts] + [outcome("bad-json", 400), outcome("bad-json", 422),
                                                             outcome("stream", 503, "queue_full")]
    report = soakreport.build(result(found))
    stream, bad = report.kinds
    assert stream.statuses == {"200": 100, "503 queue_full": 1} and stream.unexpected == 0
    assert stream.ttft_p50_ms == pytest.approx(50.5) and stream.ttft_p99_ms == pytest.approx(99.01)
    assert bad.statuses == {"400": 1, "422": 1} and bad.ttft_p50_ms is None
    server, engine = report.processes
    assert server.rss == (100 * MIB, 100 * MIB, 101 * MIB, 150 * MIB) and server.fds == (10, 12, 12, 30)
    # the engine grew 40 MiB, all of it the prompt cache's RAM tier (50 -> 90 MiB): no leak
    assert engine.rss_growth == 0 and engine.cache_growth == 40 * MIB and not engine.rss_flag
    assert report.verdict == "PASS" and report.passed
    assert soakreport.verdict_line(report).startswith("Verdict: PASS")
    text = "\n".join(soakreport.render(report))
    assert "| stream | 101 | 200: 100, 503 queue_full: 1 | 200 | 0 |" in text and "| engine m |" in text


def test_a_server_error_an_unanswered_request_or_a_restart_fails():
    for bad in (outcome("stream", 500, "engine_error"), outcome("stream", 503, "engine_crashed"),
                outcome("stream", NO_ANSWER, "ConnectionError"), outcome("bad-json", 200)):
        report = soakreport.build(result([outcome("stream", 200, ttft=5.0), bad]))
        assert report.verdict == "FAIL" and not report.passed, bad
        assert f"{bad.kind}: 1 of" in report.failures[0]
    restarted = soakreport.build(result([outcome("stream", 200, ttft=5.0)], restarts=(0, 1)))
    assert restarted.failures == ["the engine restarted 1 time(s)"]


def test_rss_growth_past_the_tolerance_or_any_fd_growth_is_a_suspected_leak():
    grown = soakreport.build(result([], readings(server_rss=(100, 100, 140))))      # +40 MiB > max(10 %, 32 MiB)
    assert grown.verdict == "LEAK?" and grown.leaks == ["server: RSS grew +40.0 MiB after warm-up"]
    within = soakreport.build(result([], readings(server_rss=(100, 100, 130))))
    assert within.leaks == []
    engine = soakreport.build(result([], readings(engine_rss=(500, 600, 700), cache=(0, 50, 60))))
    assert engine.leaks == ["engine m: RSS grew +90.0 MiB after warm-up"]               # 100 grown, 10 of it cache
    fds = soakreport.build(result([], readings(engine_fds=(20, 20, 21))))
    assert fds.leaks == ["engine m: open fds grew by 1 after warm-up"]
    # growth is judged from the warmed reading: the warm-up's own growth is not a leak
    assert soakreport.build(result([], readings(server_fds=(10, 40, 40)))).leaks == []


def test_without_process_metrics_there_is_no_leak_check_but_no_failure():
    report = soakreport.build(result([outcome("stream", 200, ttft=1.0)], [Sample(0.0, "start"), Sample(1.0, "end")]))
    assert report.processes == [] and report.passed and "no leak check" in report.notes[0]


def test_parse_metrics_reads_the_server_and_each_engine():
    text = ("# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 6.9e+07\n"
            "# TYPE process_open_fds gauge\nprocess_open_fds 15.0\n"
            "# TYPE appliance_engine_resident_memory_bytes gauge\n"
            'appliance_engine_resident_memory_bytes{model="a"} 1.0e+09\n'
            'appliance_engine_resident_memory_bytes{model="b"} 2.0e+09\n'
            "# TYPE appliance_engine_open_fds gauge\n"
            'appliance_engine_open_fds{model="a"} 11.0\nappliance_engine_open_fds{model="b"} 12.0\n'
            "# TYPE appliance_prompt_cache_ram_bytes gauge\nappliance_prompt_cache_ram_bytes 4096.0\n")
    s = parse_metrics(text, 2.5, "during")
    assert s.processes == {"server": Usage(69_000_000, 15), "engine a": Usage(10**9, 11),
                           "engine b": Usage(2 * 10**9, 12)}
    assert (s.at_s, s.point, s.cache_ram_bytes) == (2.5, "during", 4096)


def test_cache_hit_requests_share_a_document_prefix_and_misses_start_with_a_nonce():
    from appliance.bench.soakmix import _with_document

    doc = " ".join(["A shared document."] * 50)
    a = _with_document([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], doc)
    b = _with_document([{"role": "user", "content": "How?"}], doc)
    assert [m["role"] for m in a] == ["system", "user"] and [m["role"] for m in b] == ["system", "user"]
    prefix = f"Background reading:\n\n{doc}"
    assert a[0]["content"] == prefix + "\n\nBe brief." and b[0]["content"] == prefix


# -- for real ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def soak_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    db = str(tmp / "results.db")
    # as many clients as kinds: the first request of each sends every kind once (soak.py). A tiny
    # model: what is proven is each kind's status and what is stored and printed, not what a
    # model says (CI time)
    tiny = write_tiny_llama(tmp / "tiny.gguf", n_ctx=1024)
    with running_server(tmp, "--model", str(tiny), "--n-ctx", "1024", "--n-slots", "4") as srv:
        out = subprocess.run([sys.executable, "-m", "appliance", "bench", "--url", srv.url, "--soak", "0.05",
                              "--soak-clients", str(len(KINDS)), "--quiet", "--db-path", db],
                             capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with Store.open(db) as s:
        info = s.last_run()
        return out, info, s.host(info.id), s.results(info.id)


def test_a_short_soak_stores_and_prints_every_kind_by_status(soak_run):
    out, info, host, cells = soak_run
    assert out.returncode in (0, 1), out.stderr + out.stdout
    report = soakreport.from_stored(host, cells)
    assert info.kind == "soak" and info.command[:3] == ("appliance", "bench", "--url")
    # every kind was sent and answered as it expects: 200s, 400 past the context, 4xx for bad bodies
    statuses = {r.kind: r.statuses for r in report.kinds}
    assert set(statuses) == {k.name for k in KINDS} and report.failures == [], report.failures
    for kind in ("chat", "stream", "tools", "structured", "cancel"):
        assert set(statuses[kind]) <= {"200", "503 queue_full"} and statuses[kind].get("200"), (kind, statuses)
    assert statuses["over-context"] == {"400": statuses["over-context"]["400"]}
    assert all(k.startswith("4") for kind in ("bad-json", "bad-types") for k in statuses[kind])
    assert {c.extra["cell"] for c in cells} == {f"soak {k.name}" for k in KINDS}
    stream = next(r for r in report.kinds if r.kind == "stream")
    assert stream.ttft_p50_ms > 0 and stream.ttft_p99_ms >= stream.ttft_p50_ms
    # the server's and its engine's resources at each quiet point, from /metrics
    names = [p.name for p in report.processes]
    assert names[0].startswith("engine ") and "server" in names
    for p in report.processes:
        assert all(v and v > 0 for v in p.rss) and all(v and v > 0 for v in p.fds)
    assert [s["point"] for s in host.snapshot["soak"]["samples"]][::len(host.snapshot["soak"]["samples"]) - 1] \
        == ["start", "end"]
    # what it printed is what `appliance results` shows, and the exit status is the verdict's
    assert "| kind | requests | by status |" in out.stdout and soakreport.verdict_line(report) in out.stdout
    assert (out.returncode == 0) == report.passed
    assert info.status is (RunStatus.COMPLETE if report.passed else RunStatus.FAILED)
