"""The tuned plan's GEMM section: saved and loaded with the llama.cpp entries, used only under
its own fingerprint (refused, with the differing fields, on any other), its misses recorded in
the plan's misses file beside llama.cpp's and read back by `tune --gemm`, and `appliance tune
--gemm --gemm-interpret` end to end writing a plan whose GEMM entries the loader accepts."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import tune, tune_gemm
from appliance.compute_settings import LlamaCppSettings
from appliance.engine import plan as plan_mod
from appliance.engine.plan import LlamaCppChoice, Plan, PlanRefused
from kernels.plan import GemmEntry, GemmKey, GemmTable, gemm_fingerprint
from kernels.wgemm import DEFAULT, GemmConfig

ROOT = Path(__file__).resolve().parent.parent
FP = {"appliance": "0.1.0", "kernel_sources": "abc", "llama_cpp_python": "0.3.36", "llama_cpp_build": "AVX2 = 1",
      "torch": "absent", "triton": "absent", "backend": "llama.cpp-cpu", "device": "cpu", "arch": "x86_64",
      "runtime": "none", "cpu_model": "AMD EPYC"}
GFP = {"device": "NVIDIA H200", "capability": "9.0", "runtime": "cuda 12.8", "driver": "570.124.06",
       "torch": "2.13.0", "triton": "3.9.0", "kernel_sources": "def"}
KEY = GemmKey("wgemm", "q4_0", 4096, 4096)
TABLE = GemmTable(GFP, {KEY: {"1-16": GemmEntry(GemmConfig(16, 64, 128, 2), 21.5, 0.003),
                              "257+": GemmEntry(GemmConfig(128, 128, 128, 2, 8, 4), 910.0, 0.004)}})
LLAMA = {"98:abc": (LlamaCppChoice(1 << 30, LlamaCppSettings(2, 2, 512, 512, False)),)}
PLAN = Plan(fingerprint=FP, llamacpp=LLAMA, gemm=TABLE.to_json())


def test_a_plan_with_gemm_entries_round_trips(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    assert plan_mod.load(path, FP) == PLAN and plan_mod.parse(PLAN.to_json()).to_json() == PLAN.to_json()
    assert plan_mod.load_gemm(path, GFP) == TABLE
    assert json.loads(path.read_text())["gemm"]["entries"][0]["bucket"] == "1-16"
    assert "gemm" not in json.loads(Plan(fingerprint=FP, llamacpp=LLAMA).to_json())   # old form unchanged
    assert PLAN.hash != Plan(fingerprint=FP, llamacpp=LLAMA).hash


@pytest.mark.parametrize("field", sorted(GFP))
def test_the_gemm_entries_are_refused_on_any_other_fingerprint_field(tmp_path, field, caplog):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    here = GFP | {field: "something else"}
    with pytest.raises(PlanRefused, match=f"another GPU or build: {field}: plan "):
        plan_mod.load_gemm(path, here)
    with caplog.at_level(logging.WARNING, "appliance.plan"):
        table, resolved = plan_mod.resolve_gemm(path, here)
    assert resolved.status == "refused" and field in resolved.reason and field in caplog.text
    assert table.entries == {} and table.fingerprint == here          # lookups then miss, and are recorded
    assert table.lookup("wgemm", "q4_0", 4096, 4096, 1) == (DEFAULT, False)
    assert plan_mod.load(path, FP).llamacpp == LLAMA                  # llama.cpp's part is judged apart


def test_a_bad_gemm_entry_refuses_the_gemm_section_only(tmp_path):
    doc = json.loads(PLAN.to_json())
    doc["gemm"]["entries"][1]["checked_vs_ref"] = False
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanRefused, match=r"gemm section is malformed \(gemm entry 1 \(wgemm q4_0 N=4096 K=4096 "
                                          r"bucket 257\+\): checked_vs_ref must be true"):
        plan_mod.load_gemm(path, GFP)
    assert plan_mod.load(path, FP).llamacpp == LLAMA
    path.write_text(json.dumps(doc | {"gemm": ["not", "a", "section"]}))
    with pytest.raises(PlanRefused, match="malformed"):
        plan_mod.load(path, FP)
    plan_mod.save(Plan(fingerprint=FP, llamacpp=LLAMA), path)
    with pytest.raises(PlanRefused, match="no gemm section"):
        plan_mod.load_gemm(path, GFP)


def test_resolve_gemm_uses_a_matching_plan_and_an_empty_table_otherwise(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    table, resolved = plan_mod.resolve_gemm(path, GFP)
    assert table == TABLE and resolved.status == "used" and resolved.hash == PLAN.hash
    assert table.lookup("wgemm", "q4_0", 4096, 4096, 300) == (GemmConfig(128, 128, 128, 2, 8, 4), True)
    assert plan_mod.resolve_gemm(tmp_path / "none.json", GFP)[1].status == "absent"
    assert plan_mod.resolve_gemm(None, GFP)[1].status == "off"


def test_a_miss_is_recorded_beside_llama_cpps_and_read_back_by_tune(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    plan_mod.resolve(path, False, FP, "77:new", 4096)                         # a llama.cpp miss
    table, _ = plan_mod.resolve_gemm(path, GFP)
    assert table.lookup("wgemm", "q4_0", 4096, 4096, 1)[1]                     # a hit: nothing recorded
    assert table.lookup("wgemm", "q8_0", 1024, 4096, 8) == (DEFAULT, False)
    assert table.lookup("wgemm", "q4_0", 4096, 4096, 32) == (TABLE.entries[KEY]["1-16"].config, False)
    table.lookup("wgemm", "q8_0", 1024, 4096, 3)                               # the same miss
    assert plan_mod.record_gemm_misses(path, table) == 2 and plan_mod.record_gemm_misses(path, table) == 0
    wanted = [{"op": "wgemm", "fmt": "q4_0", "n": 4096, "k": 4096, "bucket": "17-64"},    # in key order
              {"op": "wgemm", "fmt": "q8_0", "n": 1024, "k": 4096, "bucket": "1-16"}]
    assert plan_mod.gemm_misses(path) == wanted
    assert {"backend": "llama.cpp", "model": "77:new", "depth": 4096} in plan_mod.read_misses(path)
    assert tune_gemm.gemm_shapes(path, ["nvfp4:64:128", "q8_0:1024:4096"]) == [
        GemmKey("wgemm", "nvfp4", 64, 128), GemmKey("wgemm", "q8_0", 1024, 4096), KEY]   # once each
    plan_mod.clear_misses(path, "77:new")                                      # llama.cpp's own: gemm's stay
    assert len(plan_mod.gemm_misses(path)) == 2 and len(plan_mod.read_misses(path)) == 2
    plan_mod.clear_gemm_misses(path, [wanted[1]])
    assert plan_mod.read_misses(path) == [wanted[0]]


@pytest.mark.parametrize("spec", ["q4_0:64", "q4_0:64:100", "q9:64:128", "q4_0:x:128", "q4_0:0:128"])
def test_a_bad_gemm_shape_is_refused(tmp_path, spec):
    with pytest.raises(ValueError, match="--gemm-shape must be FMT:N:K"):
        tune_gemm.gemm_shapes(tmp_path / "plan.json", [spec])


def test_llama_cpp_tune_keeps_the_gemm_section(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    other = FP | {"cpu_model": "Intel Xeon"}              # llama.cpp's entries are another machine's
    merged = tune._merged(path, other, "55:m", LLAMA["98:abc"], plan_mod)
    assert merged.gemm == PLAN.gemm and set(merged.llamacpp) == {"55:m"}
    assert set(tune._merged(path, FP, "55:m", LLAMA["98:abc"], plan_mod).llamacpp) == {"98:abc", "55:m"}


def _tune(tmp_path, *args, env=None):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), **(env or {})}
    return subprocess.run([sys.executable, "-m", "appliance", "tune", "--gemm", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)


def test_tune_gemm_needs_a_gpu_unless_interpreted(tmp_path):
    # no CUDA device for the command, whether or not this machine has one
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "appliance", "tune", "--gemm", "--gemm-shape", "q4_0:64:128"],
                          capture_output=True, text=True, timeout=120, env=env | {"XDG_DATA_HOME": str(tmp_path)},
                          cwd=ROOT)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "--gemm-interpret" in done.stderr
    assert not (tmp_path / "appliance" / "plan.json").exists()


def test_tune_gemm_interpreted_end_to_end_writes_entries_the_loader_accepts(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "appliance" / "plan.json"
    plan_mod.save(PLAN, out)                                      # another GPU's entries; llama.cpp's are kept
    key = GemmKey("wgemm", "q4_0", 64, 128)
    untunable = {"op": "wgemm", "fmt": "q2_k", "n": 64, "k": 256, "bucket": "1-16"}   # no kernel for q2_k
    llama_miss = {"backend": "llama.cpp", "model": "77:new", "depth": 4096}
    for miss in (key.miss("17-64"), untunable, llama_miss):
        plan_mod.record_miss(out, miss)
    done = _tune(tmp_path, "--gemm-interpret", "--gemm-shape", "q4_0:64:128")
    assert done.returncode == 0, done.stderr
    assert "| q4_0:64:128 | 1-16 | 1 |" in done.stdout and "| 257+ |" in done.stdout and str(out) in done.stdout
    assert "1 shapes x 4 buckets" in done.stderr and "timed" in done.stderr
    assert "GEMM entries were tuned for another GPU" in done.stderr          # the old section, replaced
    table = plan_mod.load_gemm(out, gemm_fingerprint("cpu"))
    assert list(table.entries) == [key] and list(table.entries[key]) == ["1-16", "17-64", "65-256", "257+"]
    assert len({(e.config.block_k, e.config.split_k, e.config.dot) for e in table.entries[key].values()}) == 1
    assert all(e.checked_vs_ref and e.max_rel_err < 1e-5 for e in table.entries[key].values())
    assert all(table.lookup("wgemm", "q4_0", 64, 128, m)[1] for m in (1, 16, 17, 200, 5000))
    assert plan_mod.load(out, FP).llamacpp == LLAMA
    assert plan_mod.read_misses(out) == [untunable, llama_miss]              # the covered miss cleared
