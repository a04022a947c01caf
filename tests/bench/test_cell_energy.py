"""Each cell's joules from the sampler's spans, stored beside the rates (old files migrated), and
what the report, the comparison and the estimate make of them: tokens per joule gross and above
idle, the envelope verdict, and `unavailable (reason)` where nothing was measured."""
from __future__ import annotations

import sqlite3

import pytest

from appliance.bench import results
from appliance.bench.energy import idle_watts, measure_idle, served_energy, shared_energy
from appliance.bench.energy_report import envelope_verdict, envelopes
from appliance.bench.session import Phases, phase_summary
from appliance.store import Store
from hostcheck.sampler import Sampler
from tests.hostcheck.test_sampler import Clock

from .test_results import cell, curve_cells, report, stored

NO_READER = "no power reader: RAPL: no /sys/class/powercap; hwmon: no /sys/class/hwmon"


class Watts:
    """A power reader reading a constant `w` watts."""

    name, gives_power = "board", True

    def __init__(self, w):
        self.w = w

    def read(self, now):
        return {"power_w": self.w}


def test_a_served_cell_gets_its_prefill_and_decode_joules():
    s = Sampler(Watts(50.0), clock=Clock(step=1.0))
    with Phases(s) as phases:       # prefill entry t=1, exit t=2
        pass                        # no first token: the whole request was prefill
    e = phases.energy()
    assert (e["prefill_j"], e["prefill_s"], e["request_j"], e["energy_note"]) == (50.0, 1.0, 50.0, "")
    with Phases(s) as phases:
        phases.first_token()
        s.tick()
    e = phases.energy()
    assert (e["prefill_j"], e["decode_j"], e["decode_s"], e["request_j"]) == (50.0, 100.0, 2.0, 150.0)


def test_a_batch_shares_its_joules_and_no_reader_gives_the_reason():
    s = Sampler(Watts(40.0), clock=Clock(step=1.0))
    with s.phase("concurrent") as span:
        pass
    assert shared_energy(s, span, 4) == {"request_j": 10.0, "request_s": 1.0,
                                         "energy_note": "one 4-way batch's joules shared equally"}
    quiet = Sampler(clock=Clock(), no_energy=NO_READER)
    with Phases(quiet) as phases:
        phases.first_token()
    assert phases.energy() == {"prefill_s": 1.0, "decode_s": 1.0, "request_s": 2.0, "energy_note": NO_READER}
    assert served_energy(None, None, None) == {"energy_note": "no host sampler"}


def test_idle_is_measured_first_and_stored_beside_the_medians():
    s = Sampler(Watts(8.0), clock=Clock(step=0.5))
    measure_idle(s, 2.0, sleep=lambda t: None)
    with Phases(s) as phases:
        phases.first_token()
    summary = phase_summary(s)
    assert summary["idle"] == {"median_power_w": 8.0, "median_cpu_mhz": None, "median_gpu_mhz": None,
                                    "n_samples": 1, "seconds": 0.5, "joules": 4.0, "energy_note": "",
                                    "joules_by_reader": {"board": 4.0}}
    assert idle_watts(summary) == 8.0
    assert summary["decode"]["joules"] == 4.0
    measure_idle(s, 0.0)            # --idle-seconds 0: no idle phase
    assert list(phase_summary(s)) == ["idle", "prefill", "decode"]


def energetic(label, w, repeat=0, **kw):
    """A cell whose prefill ran 2.5 s and decode 1.4 s at `w` watts."""
    return cell(label, repeat_index=repeat, prefill_j=2.5 * w, prefill_s=2.5, decode_j=1.4 * w, decode_s=1.4,
                request_j=3.9 * w, request_s=3.9, **kw)


def test_the_report_shows_tokens_per_joule_gross_and_above_idle(tmp_path):
    cells = [energetic("sweep p=2048", 100.0, r) for r in range(3)]
    store, run_id = stored(tmp_path, cells)
    with store:
        store.record_host(run_id, {}, {"idle": {"joules": 20.0, "seconds": 2.0, "energy_note": ""}})
        c = store.results(run_id)[0]
        md = report(store, run_id)
    assert c.prefill_j == 250.0 and c.prefill_tpj == pytest.approx(819.2 / 100.0)
    assert c.decode_tpj == pytest.approx(0.9)
    assert "| prefill tok/J | decode tok/J |" in md.replace("| gap |", "|")
    assert "### Energy: gross, and above the idle power (idle 10.0 W over 2.0 s before the first cell)" in md
    # 390 J gross, 390 - 10 W x 3.9 s = 351 J above idle; decode 90 tok/s at 100 W gross, 90 W above idle
    assert "| sweep p=2048 | served | - | 390.00 | 351.00 | 8.19 | 9.10 | 0.900 | 1.000 |" in md


def test_where_nothing_was_measured_the_report_says_why(tmp_path):
    store, run_id = stored(tmp_path, [cell(energy_note=NO_READER)])
    with store:
        md = report(store, run_id)
        e = results.estimate(curve_cells({512: 1000.0}, {512: 50.0}), 512, 10)
    assert f"Energy per cell: unavailable ({NO_READER})." in md
    assert "tok/J" not in md
    assert e.prefill_j is None and "unavailable" in results.render_estimate(e)


def test_the_estimate_gives_joules_beside_seconds():
    cells = [cell(f"p={p}", prompt_tokens=p, depth=p, prefill_tps=1000.0, client_decode_tps=50.0,
                  prefill_j=p / 1000.0 * 100.0, prefill_s=p / 1000.0, decode_j=10.0, decode_s=0.2)
             for p in (512, 8192)]
    e = results.estimate(cells, 2048, 100)
    assert e.prefill_j == pytest.approx(204.8)        # 10 tok/J
    assert e.decode_j == pytest.approx(100.0)         # 50 tok/s at 50 W: 1 tok/J
    assert "energy: prefill 204.8 J, decode 100.0 J, total 304.8 J" in results.render_estimate(e)


def test_compare_pairs_tokens_per_joule_too():
    a = [energetic("p", 100.0, r) for r in range(2)]
    b = [energetic("p", 80.0, r) for r in range(2)]
    (row,) = results.compare(a, b)
    assert row.decode_tpj.ratio == pytest.approx(100.0 / 80.0) and row.decode_tpj.pairs == 2


def test_envelopes_name_the_best_per_joule_and_the_fastest_and_what_each_costs():
    cells = [energetic("p", 60.0, power_cap_w=60.0, client_decode_tps=80.0),
             energetic("p", 120.0, power_cap_w=120.0, client_decode_tps=100.0)]
    found = envelopes(cells)
    assert [(e.cap_w, e.decode_tps) for e in found] == [(60.0, 80.0), (120.0, 100.0)]
    # decode tok/J: 80 x 1.4 / 84 = 1.333 at 60 W; 100 x 1.4 / 168 = 0.833 at 120 W
    assert envelope_verdict(found) == [
        "- fastest decode: 120 W, 100.0 tok/s, 0.833 tok/J",
        "- best decode tokens per joule: 60 W, 1.333 tok/J, 80.0 tok/s",
        "- 60 W against 120 W: -20.0% tok/s for +60.0% tok/J"]


def test_an_old_file_is_migrated_and_its_cells_say_they_predate_energy(tmp_path):
    path = tmp_path / "old.db"
    store, run_id = stored(tmp_path, [cell()])
    store.close()
    (tmp_path / "results.db").rename(path)
    conn = sqlite3.connect(path)          # back to the schema before 0004
    for col in ("prefill_j", "prefill_s", "decode_j", "decode_s", "request_j", "request_s", "power_cap_w",
                "energy_note"):
        conn.execute(f"ALTER TABLE results DROP COLUMN {col}")
    conn.execute("DELETE FROM _migrations WHERE name = '0004_cell_energy_power_cap'")
    conn.commit()
    conn.close()
    with Store.open(path) as again:
        (c,) = again.results(run_id)
        md = report(again, run_id)
    assert c.request_j is None and c.energy_note == "stored before energy was measured"
    assert "Energy per cell: unavailable (stored before energy was measured)." in md


def test_the_plot_adds_tokens_per_joule_panels_where_energy_was_measured(tmp_path):
    pytest.importorskip("matplotlib")
    from .test_results import _info

    plain = curve_cells({512: 900.0, 2048: 850.0}, {512: 60.0, 8192: 50.0})
    assert results.plot([(_info(1), plain)], tmp_path / "a.png") == ["Decode at depth", "Prefill"]
    measured = [energetic(f"p={p}", 100.0, prompt_tokens=p, depth=p) for p in (512, 2048)]
    titles = results.plot([(_info(1), plain), (_info(2), measured)], tmp_path / "b.png")
    assert titles == ["Decode at depth", "Prefill", "Decode energy at depth", "Prefill energy"]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_phase_keeps_its_joules_per_reader(tmp_path):
    class Package(Watts):
        name = "rapl"

    s = Sampler(Package(20.0), Watts(80.0), clock=Clock(step=1.0))
    for _ in range(2):
        with Phases(s) as phases:
            phases.first_token()
    summary = phase_summary(s)
    assert summary["decode"]["joules"] == 200.0
    assert summary["decode"]["joules_by_reader"] == {"rapl": 40.0, "board": 160.0}
    store, run_id = stored(tmp_path, [energetic("p", 100.0)])
    with store:
        store.record_host(run_id, {}, summary)
        md = report(store, run_id)
    assert "| decode | 100.0 | unavailable | unavailable | 2 | 200.0 (board 160.0, rapl 40.0) | 2.0 |" in md  # stored sorted


def test_the_reason_given_is_the_one_most_cells_give():
    from appliance.bench.energy_report import why_none

    cells = [cell(energy_note="no reply to measure (HTTP 400)")] + [cell(energy_note=NO_READER)] * 2
    assert why_none(cells) == NO_READER
    assert why_none([cell()]) == ""
