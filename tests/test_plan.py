"""The tuned plan: used whole or refused whole, pure lookups, misses recorded, and `tune` on a
tiny model writing a plan that the engine then uses (visible in /health)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from appliance.compute_settings import LlamaCppSettings
from appliance.config import EngineConfig
from appliance.engine import plan as plan_mod
from appliance.tune_score import candidates
from appliance.engine.plan import LlamaCppChoice, Plan, PlanRefused
from appliance.models import file_fingerprint
from appliance.tune_score import Measurement, choose, depth_ranges

FP = {"appliance": "0.1.0", "kernel_sources": "abc", "llama_cpp_python": "0.3.36", "llama_cpp_build": "AVX2 = 1",
      "torch": "absent", "triton": "absent", "backend": "llama.cpp-cpu", "device": "cpu", "arch": "x86_64",
      "runtime": "none", "cpu_model": "AMD EPYC"}


def choice(depth_max: int, **kw) -> LlamaCppChoice:
    values = dict(n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512, flash_attn=False)
    return LlamaCppChoice(depth_max=depth_max, settings=LlamaCppSettings(**(values | kw)))


PLAN = Plan(fingerprint=FP, llamacpp={"98:abc": (choice(1280, n_ubatch=256), choice(4096),
                                                 choice(1 << 30, flash_attn=True))})


def test_round_trip_and_a_stable_hash(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    loaded = plan_mod.load(path, FP)
    assert loaded.llamacpp == PLAN.llamacpp and loaded.hash == PLAN.hash
    assert not list(tmp_path.glob("*.tmp"))


def test_lookup_is_a_pure_function_of_model_and_depth():
    assert PLAN.lookup("98:abc", 0).settings.n_ubatch == 256
    assert PLAN.lookup("98:abc", 1280).settings.n_ubatch == 256
    assert PLAN.lookup("98:abc", 1281).settings.n_ubatch == 512 and not PLAN.lookup("98:abc", 4096).settings.flash_attn
    assert PLAN.lookup("98:abc", 10**6).settings.flash_attn
    assert [PLAN.lookup("98:abc", 3000) for _ in range(3)] == [PLAN.lookup("98:abc", 3000)] * 3
    assert PLAN.lookup("other", 100) is None


def test_a_fingerprint_mismatch_refuses_the_whole_plan_naming_what_differs(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    here = FP | {"cpu_model": "Intel Xeon", "llama_cpp_python": "0.3.40"}
    with pytest.raises(PlanRefused) as e:
        plan_mod.load(path, here)
    assert "cpu_model" in str(e.value) and "llama_cpp_python" in str(e.value) and "arch" not in str(e.value)
    got, resolved = plan_mod.resolve(path, True, here, "98:abc", 2048)
    assert got is None and resolved.status == "refused" and "cpu_model" in resolved.reason


# a plan file as `tune` has always written it: the settings flat beside depth_max and measured
V1_FILE = """\
{
 "created_at": "2025-01-02T03:04:05+00:00",
 "fingerprint": {
  "appliance": "0.1.0",
  "cpu_model": "AMD EPYC"
 },
 "llamacpp": {
  "98:abc": [
   {
    "depth_max": 1280,
    "flash_attn": false,
    "measured": {
     "0": {
      "score_s": 0.5
     },
     "depth": 512
    },
    "n_batch": 512,
    "n_threads": 2,
    "n_threads_batch": 2,
    "n_ubatch": 256
   },
   {
    "depth_max": 1073741824,
    "flash_attn": true,
    "measured": {},
    "n_batch": 512,
    "n_threads": 4,
    "n_threads_batch": 4,
    "n_ubatch": 512
   }
  ]
 },
 "version": 1
}
"""


def test_the_plan_file_format_is_unchanged():
    plan = plan_mod.parse(V1_FILE)
    first, last = plan.llamacpp["98:abc"]
    assert first == LlamaCppChoice(1280, LlamaCppSettings(2, 2, 512, 256, False), {"depth": 512, "0": {"score_s": 0.5}})
    assert last.settings == LlamaCppSettings(4, 4, 512, 512, True) and last.measured == {}
    assert plan.to_json() == V1_FILE


@pytest.mark.parametrize("text, words", [("{not json", "not valid JSON"), ('{"version": 9}', "version-1"),
                                         ('{"version": 1, "fingerprint": {}, "llamacpp": {"m": [{"depth_max": 1}]}}',
                                          "malformed"),
                                         (V1_FILE.replace('"n_ubatch": 256', '"n_ubatch": 0'), "malformed")])
def test_a_corrupt_file_is_refused_with_a_clear_message(tmp_path, text, words):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanRefused, match=words):
        plan_mod.load(path, FP)


def test_a_miss_is_recorded_on_a_first_start_before_the_data_directory_exists(tmp_path):
    path = tmp_path / "not-yet" / "appliance" / "plan.json"      # no plan: the default location
    plan_mod.record_miss(path, {"backend": "llama.cpp", "model": "77:new", "depth": 512})
    assert plan_mod.read_misses(path) == [{"backend": "llama.cpp", "model": "77:new", "depth": 512}]


def test_a_miss_keeps_the_defaults_and_records_its_key(tmp_path):
    path = tmp_path / "plan.json"
    plan_mod.save(PLAN, path)
    got, resolved = plan_mod.resolve(path, False, FP, "77:new", 4096)
    assert got is None and resolved.status == "miss" and resolved.misses == 1
    plan_mod.resolve(path, False, FP, "77:new", 4096)   # recorded once
    assert plan_mod.read_misses(path) == [{"backend": "llama.cpp", "model": "77:new", "depth": 4096}]
    plan_mod.clear_misses(path, "77:new")
    assert plan_mod.read_misses(path) == []
    got, resolved = plan_mod.resolve(path, False, FP, "98:abc", 4096)
    assert got == choice(4096) and resolved.status == "used" and resolved.hash == PLAN.hash
    assert plan_mod.resolve(tmp_path / "none.json", False, FP, "98:abc", 1)[1].status == "absent"


def _plan_here(tmp_path, **settings) -> tuple[str, object]:
    """A plan made on this machine for a stand-in model file, with one entry for any depth."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF stand-in")
    here = plan_mod.current_fingerprint(plan_mod.llama_cpp_build())
    values = dict(n_threads=3, n_threads_batch=5, n_batch=256, n_ubatch=128, flash_attn=True) | settings
    plan_mod.save(Plan(fingerprint=here, llamacpp={file_fingerprint(model): (choice(1 << 30, **values),)}),
                  tmp_path / "plan.json")
    return str(tmp_path / "plan.json"), model


def test_apply_fills_only_the_settings_left_at_their_defaults(tmp_path):
    # (startup resolves --engine auto, the default, before it applies the plan: engine_choice.py)
    path, model = _plan_here(tmp_path)
    cfg, resolved = plan_mod.apply(EngineConfig(plan=path, engine="llamacpp", n_ctx=1024, prefill_chunk=256, n_ubatch=64), model)
    assert resolved.status == "used" and resolved.choice["n_threads_batch"] == 5
    assert (cfg.n_threads, cfg.n_threads_batch, cfg.n_batch, cfg.n_ubatch, cfg.flash_attn) == (3, 5, 256, 64, True)
    assert cfg.n_ctx == 1024 and cfg.prefill_chunk == 256


def test_apply_raises_n_batch_to_the_prefill_chunk(tmp_path):
    path, model = _plan_here(tmp_path)
    cfg, _ = plan_mod.apply(EngineConfig(plan=path, engine="llamacpp"), model)     # the default chunk, 512
    assert cfg.n_batch == 512 and cfg.n_ubatch == 128
    assert plan_mod.fill_defaults(EngineConfig(prefill_chunk=64), LlamaCppSettings(1, 1, 32, 32, False)).n_batch == 64


def test_apply_leaves_the_config_alone_when_off_another_engine_or_a_miss(tmp_path):
    path, model = _plan_here(tmp_path)
    off = EngineConfig(plan="off")
    assert plan_mod.apply(off, model) == (off, plan_mod.Resolved("off"))
    torch_cfg = EngineConfig(plan=path, engine="torch")
    cfg, resolved = plan_mod.apply(torch_cfg, model)
    assert cfg == torch_cfg and resolved.status == "off" and "torch" in resolved.reason
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    cfg, resolved = plan_mod.apply(EngineConfig(plan=path, engine="llamacpp"), other)
    assert cfg == EngineConfig(plan=path, engine="llamacpp") and resolved.status == "miss"


def test_choose_takes_the_lowest_score_and_gives_near_ties_to_the_earlier_candidate():
    cands = [{"n": 0}, {"n": 1}, {"n": 2}]
    measured = [Measurement(0, 512, 1000.0, 100.0), Measurement(1, 512, 1010.0, 101.0),   # 1% better
                Measurement(2, 512, 400.0, 50.0)]
    assert choose(cands, measured, 512)[0] == 0
    measured.append(Measurement(1, 2048, 2000.0, 200.0))
    measured.append(Measurement(0, 2048, 500.0, 60.0))
    winner, medians = choose(cands, measured, 2048)
    assert winner == 1 and medians[1]["score_s"] == pytest.approx(512 / 2000 + 128 / 200)
    assert depth_ranges([512, 6144, 2048]) == [1280, 4096, 1 << 30]


def test_a_candidate_that_keeps_the_cache_to_whole_blocks_pays_the_recompute_in_its_score():
    # flash attention decodes 5% faster here, but the prompt cache can then reuse whole blocks only:
    # a follow-up recomputes half a block more on average, which costs more than the decode gains
    cands = [{"fa": False}, {"fa": True}]
    measured = [Measurement(0, 512, 1000.0, 95.0), Measurement(1, 512, 1000.0, 100.0, grid_reuse=True)]
    winner, medians = choose(cands, measured, 512)
    assert winner == 0 and medians[1]["score_s"] == pytest.approx((512 + 256) / 1000 + 128 / 100)


def test_candidates_come_in_a_fixed_order():
    cands = candidates(2, 4)
    assert cands[0].as_dict() == {"n_threads": 2, "n_threads_batch": 2, "n_batch": 512, "n_ubatch": 512,
                                  "flash_attn": False}
    assert len(cands) == 8 and cands == candidates(2, 4)
    assert {c.n_threads for c in candidates(2, 2)} == {2}


def test_tune_on_a_tiny_model_writes_a_plan_the_engine_uses(tmp_path):
    from .engine.gguf_fixtures import write_tiny_llama
    from .web.conftest import running_server

    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "appliance", "tune", "--model", str(tiny), "--depths", "32,96",
                           "--n-ctx", "128", "--n-slots", "1", "--runs", "1", "--tokens", "4", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert "| 32 |" in done.stdout and "**yes**" in done.stdout and str(out) in done.stdout
    assert "| prompt reuse |" in done.stdout
    doc = json.loads(out.read_text())
    (entries,) = doc["llamacpp"].values()
    assert all("min_chunk" in m for e in entries for k, m in e["measured"].items() if k.isdigit())
    assert [e["depth_max"] for e in entries] == [64, 1 << 30]
    with running_server(tmp_path, "--model", str(tiny), "--n-ctx", "128", "--n-slots", "1",
                        "--plan", str(out)) as server:
        settings = requests.get(server.url + "/health", timeout=10).json()["settings"]
    assert settings["plan"]["status"] == "used" and settings["plan"]["path"] == str(out)
    chosen = entries[0]      # the working depth, half of the 128-token context, is in the first range (to 64)
    assert settings["n_ubatch"] == chosen["n_ubatch"] and settings["flash_attn"] == chosen["flash_attn"]
    assert settings["plan"]["choice"]["n_ubatch"] == chosen["n_ubatch"]


def test_tune_past_the_trained_context_takes_the_rope_flags_serve_takes(tmp_path):
    """A context past the trained one is refused without scaling, as serve refuses it, and
    measured with the scaling given (the raw workers and the start-up check rotate as served)."""
    from .engine.gguf_fixtures import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "tiny.gguf", n_ctx=64)
    out = tmp_path / "plan.json"
    base = [sys.executable, "-m", "appliance", "tune", "--model", str(tiny), "--depths", "96", "--n-ctx", "128",
            "--n-slots", "1", "--runs", "1", "--tokens", "4", "--out", str(out), "--quiet"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "past the model's trained context (64 positions)" in refused.stderr
    assert "--rope-scaling yarn" in refused.stderr and not out.exists()
    done = subprocess.run([*base, "--rope-scaling", "yarn", "--rope-scale", "2"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    (entries,) = json.loads(out.read_text())["llamacpp"].values()
    rope = entries[0]["measured"]["rope"]
    assert rope["kind"] == "yarn" and rope["freq_scale"] == 0.5 and rope["orig_ctx"] == 64
