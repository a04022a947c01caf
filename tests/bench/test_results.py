"""Rows, summaries, comparisons, estimates and rendering over synthetic cells and a real Store."""
from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from appliance.bench import report as reports
from appliance.bench import results
from appliance.bench.report import render_run
from appliance.bench.results import compare, estimate, modes_against_serial
from appliance.bench.rows import Stat, rows
from appliance.store import ModelFingerprint, ResultCell, RunInfo, RunStatus, Store
from hostcheck.cpu import CpuInfo
from hostcheck.facts import Unavailable
from hostcheck.gpu_types import GpuInfo, GpuReport
from hostcheck.iommu import IommuInfo
from hostcheck.kernel import KernelInfo
from hostcheck.memory import MemoryInfo
from hostcheck.power import PowerDomain, PowerInfo
from hostcheck.snapshot import HostSnapshot

MODEL = ModelFingerprint(name="tiny.gguf", sha256="0123456789abcdef" * 4, quant="Q4_K_M",
                         size_bytes=2**30)
CMDLINE = "BOOT_IMAGE=/vmlinuz root=UUID=1234 ro quiet amd_iommu=off amdgpu.gttsize=126976"


def cell(label: str = "sweep p=2048", **kw) -> ResultCell:
    values = dict(mode="serial", prompt_set="synthetic", depth=2048, prompt_tokens=2048,
                  generated_tokens=128, ttft_ms=2500.0, prefill_tps=819.2, client_decode_tps=90.0,
                  engine_decode_tps=92.0, tokens_per_step=1.0)
    extra = {"cell": label, **kw.pop("extra", {})}
    return ResultCell(**(values | kw), extra=extra)


def snapshot() -> dict:
    gone = Unavailable("no /sys/devices/system/cpu/cpu0/cpufreq")
    cpu = CpuInfo(model="AMD RYZEN AI MAX+ 395", vendor="AuthenticAMD", logical_cpus=32,
                  physical_cores=16, smt_active=True, smt_control="on", virtual_machine=False,
                  scaling_driver="amd-pstate-epp", governor="performance",
                  energy_perf_preference=gone, boost=True, cur_mhz=3000.0, max_mhz=5100.0)
    gpu = GpuInfo(vendor="AMD", name="Radeon 8060S", arch="gfx1151", pci_slot="0000:c5:00.0",
                  driver="amdgpu", runtime="ROCm 7.14.0", vram_bytes=512 * 2**20,
                  gtt_bytes=Unavailable("no mem_info_gtt_total"), unified=True, cur_mhz=600.0,
                  max_mhz=2900.0, source="sysfs")
    power = PowerDomain(label="amdgpu", kind="hwmon", path="/sys/class/hwmon/hwmon5",
                        power_w=12.0, cap_w=85.0, default_cap_w=120.0, max_cap_w=140.0)
    return HostSnapshot(
        taken_at="2026-01-02T03:04:05+00:00", cpu=cpu,
        memory=MemoryInfo(total_bytes=128 * 2**30, available_bytes=100 * 2**30,
                          thp_enabled="madvise", thp_defrag="madvise"),
        kernel=KernelInfo(release="6.17.0-8-generic", cmdline=CMDLINE,
                          distribution="Ubuntu 24.04"),
        gpu=GpuReport(gpus=(gpu,), gtt_limits=Unavailable("amdgpu.gttsize not set")),
        iommu=IommuInfo(mode="off", source="/sys/class/iommu", units=()),
        power=PowerInfo(domains=(power,))).to_dict()


PHASES = {"prefill": {"median_power_w": 84.6, "median_cpu_mhz": 2990.0, "median_gpu_mhz": 2358.0,
                      "n_samples": 40},
          "decode": {"median_power_w": None, "median_cpu_mhz": None, "median_gpu_mhz": 2600.0,
                     "n_samples": 12}}


def stored(tmp_path, cells, status=RunStatus.COMPLETE, note=""):
    """A real store holding one run of `cells`; returns (store, run_id)."""
    store = Store.open(tmp_path / "results.db")
    run_id = store.start_run(["appliance", "bench", "--runs", "3"],
                             {"ctx": 8192, "prompt_cache": False}, MODEL)
    store.add_cells(run_id, cells)
    store.record_host(run_id, snapshot(), PHASES)
    store.finish_run(run_id, status, note)
    return store, run_id


def report(store, run_id, fmt="md", cells=None):
    cells = store.results(run_id) if cells is None else cells
    return render_run(store.run(run_id), store.host(run_id), cells, fmt)


# -- rows ------------------------------------------------------------------------------------

def test_rows_group_by_label_target_and_variant_in_order_of_first_appearance():
    cells = [cell(repeat_index=0, ttft_ms=2400.0, prompt_tokens=2047),
             cell("sweep p=512", prompt_tokens=512, depth=512),
             cell(target="raw", engine_decode_tps=None),
             cell(repeat_index=1, ttft_ms=2600.0, prefill_tps=None, prompt_tokens=2049),
             cell(repeat_index=2, ttft_ms=2450.0, prompt_tokens=2050)]
    found = rows(cells)
    assert [(r.cell, r.target) for r in found] == [
        ("sweep p=2048", "served"), ("sweep p=512", "served"), ("sweep p=2048", "raw")]
    first = found[0]
    assert first.runs == 3
    assert first.ttft_ms == Stat(min=2400.0, median=2450.0, max=2600.0, n=3)
    assert first.prefill_tps == Stat(819.2, 819.2, 819.2, 2)      # the None is not a value
    assert first.engine_prefill_tps == Stat(None, None, None, 0)
    assert first.prompt_tokens == 2050 - 1                         # median of 2047, 2049, 2050
    assert (first.mode, first.prompt_set, first.concurrency, first.cache_on) == (
        "serial", "synthetic", 1, False)
    assert found[2].engine_decode_tps.n == 0


def test_decode_gap_is_flagged_past_ten_percent():
    cells = [cell("close", client_decode_tps=85.0, engine_decode_tps=92.0),
             cell("far", client_decode_tps=12.6, engine_decode_tps=21.3),
             cell("raw", target="raw", engine_decode_tps=None)]
    close, far, raw = rows(cells)
    assert close.extra["decode_gap"] == pytest.approx(85 / 92 - 1)
    assert close.extra["flag_gap"] is False
    assert far.extra["decode_gap"] == pytest.approx(12.6 / 21.3 - 1)
    assert far.extra["flag_gap"] is True
    assert raw.extra["decode_gap"] is None and raw.extra["flag_gap"] is False
    md = render_run(_info(), None, cells)
    assert "| -7.6% |" in md and "| -40.8% ! |" in md


def concurrency_cells(target="served", aggregates=((90.0, 92.0), (170.0, 180.0))):
    """Streams 1 and 2, two repeats each: one cell per stream, each carrying its group's
    aggregate."""
    out = []
    for streams, per_repeat in zip((1, 2), aggregates):
        for repeat, aggregate in enumerate(per_repeat):
            out += [cell(f"concurrency {streams}", kind="concurrency", concurrency=streams,
                         repeat_index=repeat, target=target, client_decode_tps=aggregate / streams,
                         extra={"stream": s, "aggregate_tps": aggregate})
                    for s in range(streams)]
    return out


def test_concurrency_aggregate_per_repeat_and_batching_gain_over_one_stream():
    cells = concurrency_cells() + concurrency_cells("raw", ((50.0, 50.0), (80.0, 90.0)))
    one, two, raw_one, raw_two = rows(cells)
    assert two.runs == 2 and two.client_decode_tps.n == 4
    assert two.extra["aggregate_tps"] == Stat(170.0, 175.0, 180.0, 2)
    assert one.extra["batching_gain"] == 1.0
    assert two.extra["batching_gain"] == pytest.approx(175.0 / 91.0)
    assert raw_two.extra["batching_gain"] == pytest.approx(85.0 / 50.0)
    alone = rows(concurrency_cells()[2:])          # no one-stream row: no gain
    assert alone[0].extra["batching_gain"] is None
    assert "| concurrency 2 | served | 2 | 170.0 / 175.0 / 180.0 | 1.92x |" in render_run(
        _info(), None, cells)


def test_agent_summary_by_hand():
    # conversation 0: four turns, conversation 1: three; TTFT ms by turn
    ttfts = {0: [30000.0, 1500.0, 1600.0, 2100.0], 1: [28000.0, 1400.0, 1900.0]}
    cells = [cell("agent", kind="agent", cache_on=True, ttft_ms=ms, prompt_tokens=30000 + 1000 * t,
                  cached_tokens=0 if t == 0 else 29000 + 900 * t,
                  extra={"conversation": conv, "turn": t})
             for conv, turns in ttfts.items() for t, ms in enumerate(turns)]
    (agent,) = rows(cells)
    e = agent.extra
    assert e["first_ttft_ms"] == Stat(28000.0, 29000.0, 30000.0, 2)
    # follow-ups sorted: 1400 1500 1600 1900 2100; median 1600; numpy's linear p95 sits at
    # rank 0.95 * 4 = 3.8, between 1900 and 2100
    assert e["followup_ttft_ms_median"] == 1600.0
    assert e["followup_ttft_ms_p95"] == pytest.approx(1900 + 0.8 * 200)
    cached = (29900 + 30800 + 31700) + (29900 + 30800)
    prompt = (31000 + 32000 + 33000) + (31000 + 32000)
    assert e["cached_share"] == pytest.approx(cached / prompt)
    # last turns 2100 and 1900 (median 2000) over second turns 1500 and 1400 (median 1450)
    assert e["last_over_second"] == pytest.approx(2000 / 1450)
    md = render_run(_info(), None, cells)
    assert "| agent | served | 1 | 28,000 / 29,000 / 30,000 | 1,600 | 2,060 | 96.3% | 1.38x |" in md


def needle(label, status, expected, found, tokens=6000):
    return cell(label, kind="needle", prompt_tokens=tokens,
                extra={"found": found, "status": status, "expected_status": expected})


def test_needle_ok_only_when_every_status_matches_and_every_200_found_the_code():
    cells = [needle("needle 6000", 200, 200, True), needle("needle 6000", 200, 200, True),
             needle("needle 12000", 200, 200, True), needle("needle 12000", 200, 200, False),
             needle("needle over", 400, 400, False), needle("needle leaky", 200, 400, True)]
    six, twelve, over, leaky = rows(cells)
    assert (six.extra["found"], six.extra["total"], six.extra["status"]) == (2, 2, [200])
    assert six.extra["ok"] is True
    assert twelve.extra["found"] == 1 and twelve.extra["ok"] is False
    assert over.extra["ok"] is True and over.extra["status"] == [400]
    assert leaky.extra["ok"] is False
    md = render_run(_info(), None, cells)
    assert "| needle 12000 | served | 6,000 | 1/2 | 200 | 200 | **NO** |" in md
    assert "| needle over | served | 6,000 | 0/1 | 400 | 400 | yes |" in md


def test_identity_failures_are_counted_and_shouted():
    cells = [cell("prompt code", mode="lookup", repeat_index=r,
                  extra={"identity": r != 1}) for r in range(3)]
    (row,) = rows(cells)
    assert row.extra["identity_failures"] == 1
    md = render_run(_info(), None, cells)
    assert "**IDENTITY CHECK FAILED (rule 12):**" in md
    assert "prompt code **(OUTPUT DIFFERS FROM SERIAL: 1)**" in md
    assert "IDENTITY" not in render_run(_info(), None, [cell()])


# -- compare ---------------------------------------------------------------------------------

def ab_cells(variant, decode_by_repeat):
    return [cell(variant=variant, repeat_index=r, client_decode_tps=v, ttft_ms=1000.0 + r)
            for r, v in enumerate(decode_by_repeat)]


def test_compare_takes_the_median_of_pairwise_ratios_not_the_ratio_of_medians():
    a = ab_cells("A", [100.0, 100.0, 400.0])
    b = ab_cells("B", [200.0, 50.0, 400.0])
    (row,) = compare(a, b)
    decode = row.client_decode_tps
    # pairs 200/100, 50/100, 400/400: median 1.0; the medians alone (100 vs 200) would say 2.0
    assert (decode.a, decode.b, decode.ratio, decode.pairs) == (100.0, 200.0, 1.0, 3)
    assert row.ttft_ms.ratio == 1.0 and row.engine_decode_tps.ratio == 1.0
    assert row.prefill_tps.pairs == 3
    md = render_run(_info(), None, a + b)
    assert "### A/B: B against A" in md
    assert "| sweep p=2048 | served | serial | 3 | 1,001 / 1,001 (+0.0%) |" in md
    assert "| 100.0 / 200.0 (+0.0%) |" in md


def test_compare_pairs_only_matched_repeats_and_rows():
    a = ab_cells("", [100.0, 120.0]) + [cell("only in a")]
    b = ab_cells("", [110.0])
    (row,) = compare(a, b, "run 1", "run 2")
    assert row.client_decode_tps.pairs == 1 and row.client_decode_tps.ratio == pytest.approx(1.1)
    assert row.client_decode_tps.a == 110.0       # the median of all of side A's cells
    text = reports.render_compare([row], "run 1", "run 2")
    assert text.startswith("### run 2 against run 1\n")
    with pytest.raises(ValueError, match="several variants"):
        compare(ab_cells("A", [1.0]) + ab_cells("B", [1.0]), b)


# -- storage and formats ---------------------------------------------------------------------

def mixed_cells():
    return ([cell(repeat_index=r, ttft_ms=2500.0 + r, engine_prefill_tps=830.0 + r)
             for r in range(3)]
            + [cell(target="raw", engine_decode_tps=None, client_decode_tps=95.5)]
            + concurrency_cells()
            + [needle("needle 6000", 200, 200, True), needle("needle over", 400, 400, False)])


def test_stored_rows_render_the_same_as_the_cells_in_memory(tmp_path):
    cells = mixed_cells()
    store, run_id = stored(tmp_path, cells)
    with store:
        assert len(store.results(run_id)) == len(cells)
        for fmt in ("md", "json", "csv"):
            assert report(store, run_id, fmt) == report(store, run_id, fmt, cells)


def test_markdown_begins_with_the_conditions(tmp_path):
    store, run_id = stored(tmp_path, mixed_cells(), RunStatus.INTERRUPTED,
                           "stopped before the depth rows")
    with store:
        md = report(store, run_id)
        counts = reports.cell_counts(store)
        listing = reports.render_runs(store.runs(), counts)
    head = md.split("### ")[0]
    assert head.startswith(f"## Run {run_id}: bench, interrupted\n")
    for expected in ("**INCOMPLETE: this run is interrupted, not complete.** stopped before the "
                     "depth rows", "tiny.gguf, Q4_K_M, sha256 0123456789ab, 1.0 GiB",
                     "engine: ctx=8192 prompt_cache=False", "AMD RYZEN AI MAX+ 395, 16 cores / "
                     "32 threads, governor performance", f"kernel command line: `{CMDLINE}`",
                     "IOMMU: off", "power amdgpu (hwmon): limit 85 W, default 120 W",
                     "VRAM 0.5 GiB, GTT unavailable (no mem_info_gtt_total)", "128.0 GiB",
                     "| prefill | 84.6 | 2,990 | 2,358 | 40 |",
                     "| decode | unavailable | unavailable | 2,600 | 12 |"):
        assert expected in head
    assert "| sweep p=2048 | served | serial | synthetic | off | 1 | 2,048 | 2,048 | 128 | 3 | " \
           "2,500 / 2,501 / 2,502 | 819.2 / 819.2 / 819.2 | 830.0 / 831.0 / 832.0 |" in md
    assert f"| {run_id} | bench |" in listing and "| interrupted | tiny.gguf Q4_K_M | 12 | " \
           "stopped before the depth rows |" in listing


def test_markdown_without_a_host_snapshot_says_so():
    md = render_run(_info(), None, [cell()])
    assert "host: unavailable (no snapshot stored with this run)" in md
    assert "INCOMPLETE" not in md


def test_csv_parses_back_to_the_same_numbers():
    cells = mixed_cells()
    text = render_run(_info(), None, cells, "csv")
    parsed = list(csv.DictReader(io.StringIO(text)))
    found = rows(cells)
    assert len(parsed) == len(found)
    for line, row in zip(parsed, found):
        assert line["run"] == "7" and line["cell"] == row.cell and line["target"] == row.target
        assert float(line["ttft_ms_median"]) == row.ttft_ms.median
        assert int(line["client_decode_tps_n"]) == row.client_decode_tps.n
        assert line["prompt_tokens"] == str(row.prompt_tokens)
    raw, two = parsed[1], parsed[3]
    assert raw["engine_decode_tps_median"] == "" and raw["decode_gap"] == ""
    assert float(two["aggregate_tps_median"]) == 175.0
    assert float(two["batching_gain"]) == pytest.approx(175.0 / 91.0)
    assert parsed[-1]["status"] == "400" and parsed[-1]["ok"] == "True"


def test_json_loads_with_run_host_and_rows(tmp_path):
    store, run_id = stored(tmp_path, ab_cells("A", [1.0, 2.0]) + ab_cells("B", [2.0, 2.0]))
    with store:
        data = json.loads(report(store, run_id, "json"))
    assert data["run"]["id"] == run_id and data["run"]["status"] == "complete"
    assert data["run"]["model"]["quant"] == "Q4_K_M"
    assert data["host"]["snapshot"]["kernel"]["cmdline"] == CMDLINE
    assert [(r["cell"], r["variant"]) for r in data["rows"]] == [
        ("sweep p=2048", "A"), ("sweep p=2048", "B")]
    assert data["rows"][0]["client_decode_tps"] == {"min": 1.0, "median": 1.5, "max": 2.0, "n": 2}
    (ab,) = data["compare"]
    assert ab["rows"][0]["client_decode_tps"]["ratio"] == 1.5      # pairs 2/1 and 2/2


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="md, json or csv"):
        render_run(_info(), None, [cell()], "xml")


# -- estimate --------------------------------------------------------------------------------

def curve_cells(prefill, decode):
    """Served serial cache-off sweep rows: prefill {tokens: rate}, decode {depth: rate}."""
    out = [cell(f"p {p}", prompt_tokens=p, depth=p, prefill_tps=r, client_decode_tps=None)
           for p, r in prefill.items()]
    out += [cell(f"d {d}", kind="depth", prompt_tokens=d, depth=d, prefill_tps=None,
                 client_decode_tps=r) for d, r in decode.items()]
    return out


def test_curves_use_only_served_serial_cache_off_single_stream_baseline_rows():
    base = curve_cells({512: 1000.0}, {512: 50.0})
    noise = [cell("raw", target="raw", prefill_tps=1.0), cell("hit", cache_on=True, prefill_tps=1.0),
             cell("lookup", mode="lookup", prefill_tps=1.0), cell("b", variant="B", prefill_tps=1.0),
             cell("conc", kind="concurrency", concurrency=2, prefill_tps=1.0,
                  extra={"stream": 0, "aggregate_tps": 1.0})]
    assert results.curves(base + noise) == ([(512, 1000.0)], [(512, 50.0)])


def test_estimate_on_a_constant_curve():
    cells = curve_cells({512: 1000.0, 8192: 1000.0}, {0: 50.0, 8192: 50.0})
    e = estimate(cells, 2048, 100, run_id=4)
    assert e.prefill_s == pytest.approx(2.048)
    assert e.decode_s == pytest.approx(2.0)
    assert e.total_s == pytest.approx(4.048)
    assert (e.prefill_tps, e.decode_tps_start, e.decode_tps_end) == (1000.0, 50.0, 50.0)
    assert e.extrapolated is False and e.source_run == 4
    assert estimate(cells, 2048, 0).decode_s == 0.0
    assert results.render_estimate(e) == (
        "prefill 2,048 tokens at 1,000 tok/s: 2.0 s; decode 100 tokens at 50..50 tok/s: 2.0 s; "
        "total 4.0 s (curves of run 4)\nenergy: unavailable (no tokens-per-joule curves)")


def test_estimate_on_a_two_point_curve_by_hand():
    # prefill falls from 1000 at 1,000 tokens to 500 at 3,000; decode from 100 at depth 0 to
    # 50 at depth 1,000: decode(x) = 100 - x / 20
    cells = curve_cells({1000: 1000.0, 3000: 500.0}, {0: 100.0, 1000: 50.0})
    e = estimate(cells, 2000, 3)
    assert e.prefill_tps == pytest.approx(750.0)
    assert e.prefill_s == pytest.approx(2000 / 750)
    # positions 2000..2002 lie past depth 1,000: the end rate, 50, is held
    assert e.decode_s == pytest.approx(3 / 50) and e.extrapolated is True
    inside = estimate(cells, 1000, 3)     # decode at 1000, 1001, 1002: past the end too
    assert inside.extrapolated is True
    e = estimate(curve_cells({1000: 1000.0, 3000: 500.0}, {0: 100.0, 4000: 50.0}), 2000, 3)
    # decode(x) = 100 - x / 80 at 2000, 2001, 2002
    expected = sum(1 / (100 - x / 80) for x in (2000, 2001, 2002))
    assert e.decode_s == pytest.approx(expected)
    assert e.decode_tps_start == pytest.approx(75.0)
    assert e.decode_tps_end == pytest.approx(100 - 2002 / 80)
    assert e.extrapolated is False
    assert e.total_s == pytest.approx(2000 / 750 + expected)


def test_estimate_past_the_curve_holds_the_end_value_and_warns():
    cells = curve_cells({1000: 1000.0, 3000: 500.0}, {0: 100.0, 4000: 50.0})
    e = estimate(cells, 10000, 10)
    assert e.prefill_tps == 500.0 and e.decode_tps_start == e.decode_tps_end == 50.0
    assert e.extrapolated is True
    assert "warning: outside the measured curves (prefill 1,000..3,000 tokens, decode at depth " \
           "0..4,000)" in results.render_estimate(e)


def test_estimate_needs_a_curve():
    with pytest.raises(ValueError, match="run 9 has no usable decode curve"):
        estimate(curve_cells({1000: 1000.0}, {}), 100, 10, run_id=9)
    with pytest.raises(ValueError, match="no usable prefill or decode curve"):
        estimate([cell(cache_on=True)], 100, 10)


def test_estimate_from_the_store_takes_the_newest_run_with_curves(tmp_path):
    store, first = stored(tmp_path, curve_cells({1000: 1000.0}, {0: 100.0}))
    with store:
        second = store.start_run(["appliance", "bench"], {}, MODEL)
        store.add_cells(second, [cell(cache_on=True)])
        assert results.estimate_from_store(store, 1000, 10).source_run == first
        with pytest.raises(ValueError):
            results.estimate_from_store(store, 1000, 10, run_id=second)


# -- plot ------------------------------------------------------------------------------------

def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    cells = curve_cells({512: 900.0, 2048: 850.0}, {512: 60.0, 8192: 50.0})
    raw = [cell("raw", target="raw", prefill_tps=700.0, client_decode_tps=55.0)]
    path = tmp_path / "curves.png"
    results.plot([(_info(1), cells + raw), (_info(2), cells)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _info(run_id=7):
    return RunInfo(id=run_id, kind="bench", command=("appliance", "bench"), engine_settings={},
                   model=MODEL, appliance_version="0.1.0", started_at="2026-01-02T03:04:05Z",
                   finished_at="2026-01-02T03:14:05Z", status=RunStatus.COMPLETE)


def test_stat_of_nothing():
    assert results.stat([None, None]) == Stat(None, None, None, 0)
    assert results.stat(np.array([1, 3, 2])) == Stat(1.0, 2.0, 3.0, 3)


def test_served_against_raw_pairs_each_repeat():
    cells = [cell("sweep p=512", target="raw", repeat_index=0, client_decode_tps=100.0),
             cell("sweep p=512", target="served", repeat_index=0, client_decode_tps=95.0),
             cell("sweep p=512", target="raw", repeat_index=1, client_decode_tps=80.0),
             cell("sweep p=512", target="served", repeat_index=1, client_decode_tps=80.0),
             cell("sweep p=64", target="served")]                       # no raw twin: left out
    (row,) = results.served_against_raw(cells)
    assert row.cell == "sweep p=512" and row.client_decode_tps.pairs == 2
    assert row.client_decode_tps.ratio == pytest.approx((0.95 + 1.0) / 2)
    assert results.served_against_raw([cell("sweep p=64")]) == []


def test_agent_replay_against_cold_at_the_same_depth():
    def agent(kind, turn, ttft, conversation=0, prompt=1000, cached=0):
        return cell("agent", kind=kind, ttft_ms=ttft, prompt_tokens=prompt, cached_tokens=cached,
                    extra={"cell": "agent" if kind == "agent" else kind, "turn": turn,
                           "conversation": conversation})
    cells = [agent("agent", 0, 5000.0), agent("agent", 1, 600.0, 0, cached=2048),
             agent("agent", 1, 800.0, 1, cached=2048), agent("agent", 2, 700.0, cached=2560),
             agent("agent-restart", 3, 1500.0, cached=2560),
             agent("agent-cold", 1, 7000.0, prompt=2300), agent("agent-cold", 2, 9000.0, prompt=2600)]
    found = results.agent_against_cold(cells)
    assert [(r["turn"], r["what"]) for r in found] == [(1, "follow-up"), (2, "follow-up"), (2, "after restart")]
    assert found[0]["ttft_ms"] == 700.0 and found[0]["ratio"] == pytest.approx(700 / 7000)
    assert found[2]["ratio"] == pytest.approx(1500 / 9000) and found[2]["cold_depth"] == 2600


def test_speculative_modes_are_compared_with_serial_pairwise_per_prompt_set():
    cells = []
    for r in range(3):
        cells += [cell("prompt code", kind="prompt", repeat_index=r, client_decode_tps=40.0 + r),
                  cell("prompt code", kind="prompt", mode="lookup", repeat_index=r,
                       client_decode_tps=80.0 + 2 * r, tokens_per_step=2.0 + r,
                       extra={"draft_n": 10, "draft_n_accepted": 7, "speculation": "lookup"})]
    (found,) = modes_against_serial(cells)
    mode, (row,), record = found
    assert mode == "lookup" and row.cell == "prompt code" and row.client_decode_tps.pairs == 3
    assert row.client_decode_tps.ratio == pytest.approx(2.0)
    assert record["prompt code"] == {"draft_n": 30, "draft_n_accepted": 21, "tokens_per_step": 3.0}
    # the rate table keeps the modes apart
    assert sorted(r.mode for r in rows(cells)) == ["lookup", "serial"]
    md = render_run(_info(), None, cells)
    assert "### Speculation: lookup against serial" in md
    assert "| prompt code | 3 | 41.0 / 82.0 (+100.0%) |" in md and "| 21 / 30 | 70% |" in md
