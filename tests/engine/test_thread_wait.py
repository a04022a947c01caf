"""--thread-wait: how the compute threads of a process wait at a barrier. libgomp (the OpenMP of
llama.cpp's CPU backend and of torch) reads it once, when it loads: the engine process and bench's
raw worker set it before they import llama.cpp or torch. Checked against libgomp itself, which
says its spin count (omp_display_env)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from appliance.compute_settings import thread_env
from appliance.config import EngineConfig

SHOW = ("import ctypes, os, sys\n"
        "from appliance.compute_settings import thread_env\n"
        "os.environ.update(thread_env(sys.argv[1]))\n"
        "from appliance.engine.loop import EngineLoop  # what engine_main imports next\n"
        "import llama_cpp\n"
        "ctypes.CDLL('libgomp.so.1').omp_display_env(1)\n")


def spin_count(wait: str) -> str:
    out = subprocess.run([sys.executable, "-c", SHOW, wait], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if not k.startswith(("OMP_", "GOMP_"))})
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stderr.splitlines() if "GOMP_SPINCOUNT" in ln)
    return line.split("=")[1].strip().strip("'")


def test_passive_threads_never_spin_and_spin_is_libgomps_default():
    assert spin_count("passive") == "0"
    assert int(spin_count("spin")) > 0


def test_the_engine_process_loads_no_openmp_before_it_sets_the_wait():
    """engine_main sets the wait first thing; it takes effect only if importing the module that
    holds engine_main loaded neither llama.cpp nor torch (a spawned child imports it first)."""
    probe = "import sys, appliance.engine.process; print(sorted({'llama_cpp', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_the_setting_follows_the_plan_by_default_and_is_checked():
    assert EngineConfig().thread_wait == "auto" and thread_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env("spin") == {}
    with pytest.raises(ValueError, match="thread_wait"):
        EngineConfig(thread_wait="busy")


def test_tune_chooses_passive_only_within_noise_of_spin():
    from appliance.tune_score import Measurement, wait_entry

    def runs(passive_decode: float) -> list:
        return [(w, Measurement(1, d, 500.0, rate)) for d in (512, 2048)
                for w, rate in (("spin", 100.0), ("passive", passive_decode))]

    entry, table = wait_entry(runs(99.5), [512, 2048], "m.gguf")
    assert entry["thread_wait"] == "passive" and "within the 2%" in entry["why"] and "passive" in table
    entry, _ = wait_entry(runs(41.0), [512, 2048], "m.gguf")       # what passive cost here (2.4x)
    assert entry["thread_wait"] == "spin" and "more than the 2%" in entry["why"]
    assert set(entry["measured"]["512"]) == {"spin", "passive"}
    assert wait_entry([], [512], "m.gguf") == (None, "")


def test_auto_resolves_from_the_plan_before_openmp_loads(tmp_path):
    """engine_main resolves `auto` first: the plan's entry for the model file (its fingerprint
    checked but for llama.cpp's build line, which needs llama.cpp loaded), else spin, saying why."""
    from appliance.engine import plan as plan_mod
    from appliance.models import file_fingerprint

    from .gguf_fixtures import write_tiny_llama

    model, plan = write_tiny_llama(tmp_path / "tiny.gguf"), tmp_path / "plan.json"
    probe = ("import sys\nfrom appliance.config import EngineConfig\nfrom appliance.engine.process import _thread_wait\n"
             f"cfg = _thread_wait(EngineConfig(model={str(model)!r}, plan={str(plan)!r}))\n"
             "print(cfg.thread_wait, sorted({'llama_cpp', 'torch'} & set(sys.modules)))")

    def resolved() -> str:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert resolved() == "spin []"
    fp = plan_mod.current_fingerprint("a build line this check does not compare")
    plan_mod.save(plan_mod.Plan(fingerprint=fp, llamacpp={}, thread_waits={
        file_fingerprint(model): {"thread_wait": "passive", "why": "written by the test"}}), plan)
    assert resolved() == "passive []"
    from appliance.engine_choice import thread_wait

    wait, why = thread_wait(EngineConfig(plan=str(plan), thread_wait="auto"), model)
    assert (wait, why) == ("passive", f"{plan}: written by the test")
    assert thread_wait(EngineConfig(plan=str(plan), thread_wait="spin"), model) == ("spin", "set by --thread-wait")
    other = write_tiny_llama(tmp_path / "other.gguf", n_layer=3)
    assert "did not measure the thread wait" in thread_wait(EngineConfig(plan=str(plan)), other)[1]


def test_bench_raw_reference_waits_as_the_server_it_is_compared_with():
    from appliance.bench.raw import RawSettings

    settings = {"n_threads": 2, "n_threads_batch": 2, "n_batch": 512, "n_ubatch": 512, "flash_attn": False,
                "prefill_chunk": 512}
    health = {"n_ctx": 1024, "n_slots": 2, "settings": {**settings, "thread_wait": "passive"}}
    assert RawSettings.from_health(health, 512).thread_wait == "passive"
    older = {**health, "settings": settings}        # a server from before the setting: libgomp's spin
    assert RawSettings.from_health(older, 512).thread_wait == "spin"
