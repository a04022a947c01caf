"""/api/bench gives each run's energy beside its rates: why there is none, or the idle power, the
rows' tokens per joule and the power envelopes with the report's verdict; the estimate's joules."""
from __future__ import annotations

import dataclasses

import pytest

from ..bench.test_cell_energy import NO_READER
from .test_bench_api import client_for, store_run, sweep_cells


def with_energy(cells, cap=None, watts=50.0):
    return [dataclasses.replace(c, prefill_j=c.ttft_ms / 1000 * watts, prefill_s=c.ttft_ms / 1000,
                                decode_j=watts, decode_s=1.0, request_j=c.ttft_ms / 1000 * watts + watts,
                                request_s=c.ttft_ms / 1000 + 1.0, power_cap_w=cap,
                                variant="" if cap is None else f"{cap:g} W") for c in cells]


def test_a_run_without_energy_says_why(tmp_path):
    path = tmp_path / "r.db"
    run_id = store_run(path, [dataclasses.replace(c, energy_note=NO_READER) for c in sweep_cells(raw=False)])
    doc = client_for(path).get(f"/api/bench/runs/{run_id}").get_json()
    assert doc["energy"] == {"idle_w": None, "unavailable": NO_READER, "envelopes": [], "verdict": []}
    assert all(r["decode_tpj"]["n"] == 0 for r in doc["rows"])
    est = client_for(path).post("/api/bench/estimate", json={"prompt_tokens": 100, "output_tokens": 10}).get_json()
    assert est["prefill_j"] is None and est["energy_note"] == NO_READER


def test_tokens_per_joule_beside_the_rates_and_the_envelopes(tmp_path):
    path = tmp_path / "r.db"
    cells = with_energy(sweep_cells(raw=False, repeats=1), 60.0, 40.0) + with_energy(
        sweep_cells(raw=False, repeats=1), 120.0, 100.0)
    run_id = store_run(path, cells)
    client = client_for(path)
    doc = client.get(f"/api/bench/runs/{run_id}").get_json()
    row = next(r for r in doc["rows"] if r["variant"] == "60 W")
    assert row["decode_tpj"]["median"] == row["client_decode_tps"]["median"] / 40.0
    assert doc["energy"]["unavailable"] is None
    assert [e["cap_w"] for e in doc["energy"]["envelopes"]] == [60.0, 120.0]
    assert doc["energy"]["verdict"][1].startswith("- best decode tokens per joule: 60 W")
    (ab,) = doc["ab"]
    assert ab["rows"][0]["decode_tpj"]["ratio"] == pytest.approx(40.0 / 100.0)


def test_the_estimate_gives_joules(tmp_path):
    path = tmp_path / "r.db"
    store_run(path, with_energy(sweep_cells(raw=False)))
    est = client_for(path).post("/api/bench/estimate", json={"prompt_tokens": 256, "output_tokens": 10}).get_json()
    # 50 W in every phase: the joules are 50 x the seconds, token by token along the curves
    assert est["prefill_j"] == pytest.approx(50.0 * est["prefill_s"])
    assert est["decode_j"] == pytest.approx(50.0 * est["decode_s"])
    assert "energy: prefill" in est["text"]
