"""/api/host over the Flask test client: a saved report (the Strix Halo fixture's hostcheck
--json), saved reports that are not one, this machine checked live (cached, refreshed), and the
loaded model's engine report feeding the advice."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from appliance.config import Config, ServerConfig
from hostcheck import as_json, check, collect
from hostcheck.cpu import CpuInfo
from hostcheck.gpu_types import GttLimits
from hostcheck.iommu import IommuInfo
from hostcheck.kernel import KernelInfo
from hostcheck.memory import MemoryInfo
from web import create_app, hostreport

from ..hostcheck import trees

GIB = 2**30
STRIX_WARNINGS = ["IOMMU passthrough (iommu=pt)", "CPU governor powersave",
                  "GTT limit below the model's size", "power cap (amdgpu)"]


def strix_halo_snapshot(tmp_path):
    root = trees.build(tmp_path / "apu", trees.strix_halo())
    return collect(root, trees.strix_halo_runner(), sleep=lambda s: None)


def write_strix_halo_report(tmp_path, name: str = "strix-halo.json") -> tuple:
    """`appliance hostcheck --json --model-bytes 70GiB` as it would print on the fixture APU,
    saved to tmp_path/name: (path, the report)."""
    snap = strix_halo_snapshot(tmp_path)
    report = as_json(snap, check(snap, model_bytes=70 * GIB))
    path = tmp_path / name
    path.write_text(json.dumps(report, indent=2))
    return path, report


class StubPool:
    """No model loaded, or the one engine given."""

    default = "stub"

    def __init__(self, engine=None):
        self.engine = engine

    def client(self, name=None):
        return self.engine


def client_for(host_report=None, engine=None):
    config = Config(server=ServerConfig(host_report=str(host_report) if host_report else None))
    return create_app(config, StubPool(engine)).test_client()


def test_a_saved_report_is_served_as_saved(tmp_path):
    path, report = write_strix_halo_report(tmp_path)
    resp = client_for(path).get("/api/host")
    assert resp.status_code == 200 and resp.is_json
    body = resp.get_json()
    assert body["source"] == "strix-halo.json"
    assert body["collected_at"] == report["snapshot"]["taken_at"]
    assert body["snapshot"] == report["snapshot"] and body["advice"] == report["advice"]
    assert [a["setting"] for a in body["advice"]] == STRIX_WARNINGS
    assert body["unavailable"] == report["unavailable"]
    assert body["cached"] is False and body["model"] is None and body["sources"] == hostreport.SOURCES


def test_a_saved_report_is_read_again_on_each_request(tmp_path):
    path, report = write_strix_halo_report(tmp_path)
    client = client_for(path)
    assert len(client.get("/api/host").get_json()["advice"]) == 4
    report["advice"] = report["advice"][:1]
    path.write_text(json.dumps(report))
    assert len(client.get("/api/host?refresh=1").get_json()["advice"]) == 1


@pytest.mark.parametrize("content, says", [
    (None, "cannot read the host report"),
    ("{\"snapshot\": ", "is not valid JSON"),
    (b"\xff\xfe not utf-8", "is not valid JSON"),
    ("[1, 2]", "is not 'appliance hostcheck --json' output"),
    ("{\"snapshot\": {}}", "is not 'appliance hostcheck --json' output"),
    ("{\"snapshot\": {}, \"advice\": {}}", "is not 'appliance hostcheck --json' output"),
    ("{\"snapshot\": {}, \"advice\": [\"x\"]}", "is not 'appliance hostcheck --json' output"),
], ids=["missing", "truncated", "binary", "array", "no-advice", "advice-object", "advice-strings"])
def test_a_bad_saved_report_is_a_json_error(tmp_path, content, says):
    path = tmp_path / "report.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    resp = client_for(path).get("/api/host")
    assert resp.status_code == 500 and resp.is_json
    err = resp.get_json()["error"]
    assert err["code"] == "host_report_unavailable" and err["type"] == "server_error"
    assert says in err["message"] and str(path) in err["message"]


def test_this_host_is_checked_then_kept_until_refresh(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hostreport, "collect", lambda: calls.append(1) or collect())
    client = client_for()
    first = client.get("/api/host").get_json()
    assert first["source"] == "this host" and first["cached"] is False
    assert first["collected_at"] == first["snapshot"]["taken_at"]
    assert {"cpu", "memory", "kernel", "gpu", "iommu", "power"} <= set(first["snapshot"])
    assert isinstance(first["advice"], list) and isinstance(first["unavailable"], dict)
    assert first["model"] is None and "llama_cpp" not in first   # no model loaded: no engine report
    again = client.get("/api/host").get_json()
    assert again["cached"] is True and again["snapshot"] == first["snapshot"] and len(calls) == 1
    assert client.get("/api/host?refresh=1").get_json()["cached"] is False and len(calls) == 2


def test_a_check_that_raises_is_a_json_error(monkeypatch):
    def broken():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(hostreport, "collect", broken)
    resp = client_for().get("/api/host")
    assert resp.status_code == 500 and resp.is_json
    err = resp.get_json()["error"]
    assert err["code"] == "host_check_failed" and "RuntimeError: probe exploded" in err["message"]


def test_the_loaded_models_engine_report_feeds_the_advice(tmp_path, monkeypatch):
    """A CPU-only llama.cpp and a 70 GiB model on the APU: the build and GTT warnings, from what
    the engine reported at load (no llama.cpp import in the server)."""
    snap = strix_halo_snapshot(tmp_path)
    monkeypatch.setattr(hostreport, "collect", lambda: snap)
    model = tmp_path / "big.gguf"
    with open(model, "wb") as f:
        f.truncate(70 * GIB)   # sparse: st_size is all model_bytes_of reads
    cpu = {"name": "CPU", "description": "AMD RYZEN AI MAX+ 395", "kind": "cpu", "free": 1, "total": 2}
    info = SimpleNamespace(backend="llama.cpp", model_path=str(model), model_name="big",
                           settings={"llama_cpp_python": "0.3.16"}, placement={"llama_devices": [cpu]})
    body = client_for(engine=SimpleNamespace(info=info)).get("/api/host").get_json()
    settings = [a["setting"] for a in body["advice"]]
    assert "llama.cpp without a GPU backend" in settings and "GTT limit below the model's size" in settings
    assert body["model"] == {"name": "big", "bytes": 70 * GIB}
    assert body["llama_cpp"] == {"version": "0.3.16", "gpu_offload": False, "devices": [
        {"name": "CPU", "description": "AMD RYZEN AI MAX+ 395", "free_bytes": 1, "total_bytes": 2, "kind": "cpu",
         "host_memory": False}]}


def test_every_fact_without_its_own_source_has_one_listed():
    def names(cls, *but):
        return {f.name for f in dataclasses.fields(cls)} - set(but)

    assert set(hostreport.SOURCES["cpu"]) == names(CpuInfo)
    assert set(hostreport.SOURCES["memory"]) == names(MemoryInfo)
    assert set(hostreport.SOURCES["kernel"]) == names(KernelInfo)
    assert set(hostreport.SOURCES["iommu"]) == names(IommuInfo, "mode", "source")  # mode: its own source
    assert set(hostreport.SOURCES["gtt_limits"]) == names(GttLimits)
