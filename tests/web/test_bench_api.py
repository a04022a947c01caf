"""/api/bench over a result store filled through Store's own writers, as sweep writes it: the list
of runs, one run with its conditions, rows, cells and chart series, two runs compared, the job
estimate, and the errors (unknown run, bad input, no store at all)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from appliance.bench import results
from appliance.bench.report import render_run
from appliance.config import Config, StoreConfig
from appliance.store import ModelFingerprint, ResultCell, RunStatus, Store
from web import create_app

from ..bench.test_results import PHASES, concurrency_cells, snapshot

MODEL = ModelFingerprint(name="tiny.Q4_K_M.gguf", sha256="ab" * 32, quant="Q4_K_M", size_bytes=2**30)
SIZES = (64, 256, 1024)
SETTINGS = {"n_ctx": 2048, "n_slots": 2, "n_threads": 4, "prefill_chunk": 512}


def sweep_cells(scale: float = 1.0, raw: bool = True, repeats: int = 2, sizes=SIZES) -> list[ResultCell]:
    """Cells as `appliance sweep` stores them: per size and repeat, served then raw; rates fall
    with depth and scale with `scale`."""
    out = []
    for size in sizes:
        for r in range(repeats):
            for target in ("served", "raw") if raw else ("served",):
                prefill = scale * (1000.0 - size / 4 + r) * (1.1 if target == "raw" else 1.0)
                decode = scale * (100.0 - size / 32 + r) * (1.05 if target == "raw" else 1.0)
                out.append(ResultCell(
                    mode="serial", prompt_set="sweep", depth=size, prompt_tokens=size, generated_tokens=16,
                    ttft_ms=1000 * size / prefill, prefill_tps=prefill, client_decode_tps=decode,
                    engine_decode_tps=None if target == "raw" else decode * 1.02, tokens_per_step=1.0,
                    repeat_index=r, target=target, engine_prefill_tps=None if target == "raw" else prefill,
                    extra={"cell": f"sweep p={size}"}))
    return out


def store_run(path: str | os.PathLike[str], cells: list[ResultCell], status=RunStatus.COMPLETE,
              note: str = "", host: bool = True, kind: str = "sweep") -> int:
    """One run written through Store's own writers, as `appliance sweep` writes it."""
    with Store.open(path) as store:
        argv = ["appliance", kind, "-p", ",".join(map(str, SIZES)), "-n", "16", "--runs", "2"]
        run_id = store.start_run(argv, SETTINGS, MODEL, kind=kind)
        if host:
            store.record_host(run_id, snapshot(), {})
        store.add_cells(run_id, cells)
        if host:
            store.record_host(run_id, {**snapshot(), "peak_rss_bytes": {"engine": 2**28}}, PHASES)
        if status is not RunStatus.RUNNING:
            store.finish_run(run_id, status, note)
    return run_id


class StubPool:
    """No engine: the bench endpoints never touch one."""

    def client(self):
        return None


def client_for(db_path: Path):
    app = create_app(Config(store=StoreConfig(db_path=str(db_path))), StubPool())
    return app.test_client()


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench-api") / "results.db"
    store_run(path, sweep_cells())                                          # 1: served and raw
    store_run(path, sweep_cells(scale=0.5, raw=False, repeats=1))           # 2: served only, half
    store_run(path, sweep_cells()[:2], RunStatus.INTERRUPTED, "stopped after 1 of 6 cells",
              host=False)                                                   # 3
    return path


@pytest.fixture()
def client(db):
    return client_for(db)


def test_runs_are_listed_newest_first_with_model_host_status_and_cell_count(client):
    res = client.get("/api/bench/runs")
    assert res.status_code == 200
    runs = res.get_json()["runs"]
    assert [r["id"] for r in runs] == [3, 2, 1]
    third, _, first = runs
    assert first["kind"] == "sweep" and first["command"][:2] == ["appliance", "sweep"]
    assert first["model"] == {"name": MODEL.name, "quant": "Q4_K_M", "size_bytes": 2**30, "sha256": MODEL.sha256}
    assert first["status"] == "complete" and first["cells"] == len(sweep_cells())
    assert first["engine"] == SETTINGS and first["started_at"] and first["finished_at"]
    host = first["host"]
    assert host["cpu"] == "AMD RYZEN AI MAX+ 395" and host["gpu"] == ["AMD Radeon 8060S"]
    assert host["memory_bytes"] == 128 * 2**30 and host["power"][0]["cap_w"] == 85.0
    assert third["status"] == "interrupted" and third["note"] == "stopped after 1 of 6 cells"
    assert third["host"] is None and third["cells"] == 2


def test_one_run_has_its_conditions_the_reports_rows_every_cell_and_series(client, db):
    doc = client.get("/api/bench/runs/1").get_json()
    assert doc["run"]["id"] == 1
    cond = doc["conditions"]
    assert cond["engine"]["n_ctx"] == 2048 and cond["phases"] == PHASES
    assert cond["host"]["peak_rss_bytes"] == {"engine": 2**28} and cond["host"]["iommu"] == "off"
    with Store.open(db) as store:
        cells = store.results(1)
        report = render_run(store.run(1), store.host(1), cells, "json")
    assert doc["rows"] == json.loads(report)["rows"]      # the same figures `results --format json` prints
    assert len(doc["rows"]) == 6 and doc["ab"] == [] and doc["kinds"] == {"sweep": results.KIND_TITLES["sweep"]}
    assert doc["cells"] == [dataclasses.asdict(c) for c in cells]
    assert len(doc["served_against_raw"]) == 3


def test_a_bench_runs_kinds_are_titled_in_the_reports_order(tmp_path):
    path = tmp_path / "results.db"
    store_run(path, concurrency_cells() + sweep_cells(raw=False, repeats=1), kind="bench")
    doc = client_for(path).get("/api/bench/runs/1").get_json()
    assert list(doc["kinds"]) == ["sweep", "concurrency"]
    (one, two) = [r for r in doc["rows"] if r["kind"] == "concurrency"]
    assert two["extra"]["batching_gain"] == pytest.approx(175.0 / 91.0)     # the report's figure
    assert doc["series"]["decode"]["lines"][0]["label"] == "served"          # sweep rows only


def test_series_are_the_stored_curves_served_and_raw_and_their_ratio(client, db):
    series = client.get("/api/bench/runs/1").get_json()["series"]
    with Store.open(db) as store:
        cells = store.results(1)
    for target, (prefill, decode) in (("served", results.curves(cells)), ("raw", results.curves(cells, "raw"))):
        (dec,) = [line for line in series["decode"]["lines"] if line["label"] == target]
        (pre,) = [line for line in series["prefill"]["lines"] if line["label"] == target]
        assert dec["points"] == [list(p) for p in decode] and [p[0] for p in dec["points"]] == list(SIZES)
        assert pre["points"] == [list(p) for p in prefill]
    assert series["decode"]["x"] == "context depth (tokens)" and series["decode"]["y"] == "client decode (tok/s)"
    ratio = {line["label"]: line["points"] for line in series["served_vs_raw"]["lines"]}
    assert set(ratio) == {"prefill", "client decode"}
    assert [x for x, _ in ratio["prefill"]] == list(SIZES)
    assert all(y == pytest.approx(1 / 1.1) for _, y in ratio["prefill"])      # pairwise served / raw
    assert all(y == pytest.approx(1 / 1.05) for _, y in ratio["client decode"])


def test_a_run_without_raw_cells_has_no_raw_lines(client):
    series = client.get("/api/bench/runs/2").get_json()["series"]
    assert [line["label"] for line in series["decode"]["lines"]] == ["served"]
    assert series["served_vs_raw"]["lines"] == []


def test_compare_gives_the_pairwise_ratios_of_matching_cells(client, db):
    res = client.get("/api/bench/compare?a=1&b=2")
    assert res.status_code == 200
    doc = res.get_json()
    assert doc["a"]["id"] == 1 and doc["b"]["id"] == 2
    with Store.open(db) as store:
        expected = results.compare(store.results(1), store.results(2), "run 1", "run 2")
    assert doc["rows"] == [dataclasses.asdict(r) for r in expected]
    # run 2 holds served cells only, repeat 0: three rows, each B/A = 0.5 on the decode rate
    assert [r["cell"] for r in doc["rows"]] == [f"sweep p={s}" for s in SIZES]
    assert all(r["client_decode_tps"]["ratio"] == pytest.approx(0.5) for r in doc["rows"])
    assert doc["series"]["b"]["decode"]["lines"][0]["label"] == "served"


@pytest.mark.parametrize("query", ["", "?a=1", "?a=1&b=x", "?a=0&b=1", "?a=-1&b=2", "?a=1&b=%C2%B2"])
def test_compare_refuses_a_missing_or_bad_id(client, query):
    res = client.get("/api/bench/compare" + query)
    assert res.status_code == 400 and res.get_json()["error"]["type"] == "invalid_request_error"


def test_estimate_is_what_results_estimate_answers(client, db):
    for body in ({"prompt_tokens": 512, "output_tokens": 100},
                 {"prompt_tokens": 512, "output_tokens": 100, "run_id": 1},
                 {"prompt_tokens": 4096, "output_tokens": 10, "run_id": 1}):
        res = client.post("/api/bench/estimate", json=body)
        assert res.status_code == 200, res.get_json()
        with Store.open(db) as store:
            expected = results.estimate_from_store(store, body["prompt_tokens"], body["output_tokens"],
                                                   body.get("run_id"))
        assert res.get_json() == dataclasses.asdict(expected) | {"text": results.render_estimate(expected)} \
            | {"prefill_range": list(expected.prefill_range), "decode_range": list(expected.decode_range)}
    # the newest run with both curves is the interrupted one: a single point, held, and said so
    assert expected.source_run == 1 and expected.extrapolated
    default = client.post("/api/bench/estimate", json={"prompt_tokens": 512, "output_tokens": 100}).get_json()
    assert default["source_run"] == 3 and default["extrapolated"] is True


@pytest.mark.parametrize("body, param", [
    ({}, "prompt_tokens"), ({"prompt_tokens": 10}, "output_tokens"),
    ({"prompt_tokens": -1, "output_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": 1.5, "output_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": True, "output_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": "10", "output_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": 1, "output_tokens": 10**9}, "output_tokens"),
    ({"prompt_tokens": 1, "output_tokens": 1, "run_id": 0}, "run_id"),
    ({"prompt_tokens": 1, "output_tokens": 1, "runs": 2}, "runs"),
])
def test_estimate_refuses_bad_input(client, body, param):
    res = client.post("/api/bench/estimate", json=body)
    assert res.status_code == 400 and res.get_json()["error"]["param"] == param


def test_estimate_refuses_a_body_that_is_not_json(client):
    assert client.post("/api/bench/estimate", data="x", content_type="text/plain").status_code == 400
    assert client.post("/api/bench/estimate", data="[1]", content_type="application/json").status_code == 400


def test_estimate_from_an_unknown_run_is_a_404(client):
    res = client.post("/api/bench/estimate", json={"prompt_tokens": 1, "output_tokens": 1, "run_id": 99})
    assert res.status_code == 404 and res.get_json()["error"]["code"] == "not_found"


def test_unknown_run_is_a_404_in_the_api_error_shape(client):
    res = client.get("/api/bench/runs/99")
    assert res.status_code == 404
    err = res.get_json()["error"]
    assert err["code"] == "not_found" and "99" in err["message"]
    assert client.get("/api/bench/compare?a=1&b=99").status_code == 404


def test_a_missing_db_is_an_empty_list_and_is_not_created(tmp_path):
    path = tmp_path / "nowhere" / "results.db"
    client = client_for(path)
    res = client.get("/api/bench/runs")
    assert res.status_code == 200 and res.get_json() == {"runs": []}
    assert client.get("/api/bench/runs/1").status_code == 404
    res = client.post("/api/bench/estimate", json={"prompt_tokens": 1, "output_tokens": 1})
    assert res.status_code == 404
    assert not path.exists() and not path.parent.exists()


def test_the_store_is_opened_read_only(tmp_path):
    path = tmp_path / "results.db"
    store_run(path, sweep_cells(raw=False, repeats=1))
    before = path.read_bytes()
    client = client_for(path)
    for url in ("/api/bench/runs", "/api/bench/runs/1", "/api/bench/compare?a=1&b=1"):
        assert client.get(url).status_code == 200
    assert path.read_bytes() == before
    with Store.open(path) as store:                    # a writer beside the readers
        store.finish_run(store.start_run(["x"], {}, MODEL), RunStatus.FAILED, "test")
        assert [r["id"] for r in client.get("/api/bench/runs").get_json()["runs"]] == [2, 1]


def test_a_run_whose_process_is_gone_is_shown_interrupted_and_left_as_stored(tmp_path):
    path = tmp_path / "results.db"
    run_id = store_run(path, sweep_cells(raw=False, repeats=1), RunStatus.RUNNING)
    with Store.open(path) as store:     # as if its bench had been killed with kill -9
        store.db.table("runs").update(run_id, {"owner_pid": int(Path("/proc/sys/kernel/pid_max").read_text())})
        store.db.conn.commit()
    before = path.read_bytes()
    client = client_for(path)
    (listed,) = client.get("/api/bench/runs").get_json()["runs"]
    shown = client.get(f"/api/bench/runs/{run_id}").get_json()["run"]
    for run in (listed, shown):
        assert run["status"] == "interrupted" and "which wrote this run, is gone" in run["note"]
    assert path.read_bytes() == before                 # the page tells it; the next writable open records it
    with Store.open(path) as store:
        assert store.db.execute("select status from runs").fetchall() == [("interrupted",)]


def test_a_store_from_an_older_appliance_is_not_migrated_by_the_page(tmp_path):
    path = tmp_path / "results.db"
    store_run(path, sweep_cells(raw=False, repeats=1))
    with Store.open(path) as store:     # as if the last migration had not been applied yet
        store.db.execute("delete from _migrations where name = '0002_cell_kind_target_variant_extra'")
        store.db.conn.commit()
    res = client_for(path).get("/api/bench/runs")
    assert res.status_code == 409 and "appliance results" in res.get_json()["error"]["message"]


def test_a_run_without_usable_curves_cannot_be_estimated(tmp_path):
    path = tmp_path / "results.db"
    store_run(path, [dataclasses.replace(c, mode="lookup") for c in sweep_cells(raw=False, repeats=1)])
    res = client_for(path).post("/api/bench/estimate", json={"prompt_tokens": 1, "output_tokens": 1})
    assert res.status_code == 400 and "curves" in res.get_json()["error"]["message"]
