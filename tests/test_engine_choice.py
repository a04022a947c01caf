"""`--engine auto` (issue 49): `appliance tune --engines llamacpp,torch` times the torch runner
beside llama.cpp's candidates and writes the faster engine per model into the plan; `serve
--engine auto` follows it, falls back to llama.cpp where the torch runner cannot serve, and says
which and why in /health."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import requests

from appliance import engine_choice
from appliance.config import EngineConfig
from appliance.engine import plan as plan_mod
from appliance.errors import ModelLoadError
from appliance.models import file_fingerprint

from .engine.gguf_fixtures import write_tiny_llama
from .web.conftest import running_server


def test_the_torch_runner_is_chosen_only_when_it_is_faster_by_more_than_a_near_tie():
    llama = {512: 1.0, 2048: 2.0}
    assert engine_choice.choose_engine({"llamacpp": llama, "torch": {512: 0.5, 2048: 1.0}})[0] == "torch"
    engine, why = engine_choice.choose_engine({"llamacpp": llama, "torch": {512: 1.0, 2048: 1.97}})
    assert engine == "llamacpp" and "0.99x" in why and "under 0.98x" in why
    # only the depths both measured count
    assert engine_choice.choose_engine({"llamacpp": llama, "torch": {512: 0.5}})[0] == "torch"
    assert engine_choice.choose_engine({"llamacpp": llama, "torch": {}}) == \
        ("llamacpp", "the torch runner was not measured")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("auto") / "tiny.gguf")


def write_plan(path, model, engine: str) -> None:
    fp = plan_mod.current_fingerprint(plan_mod.llama_cpp_build())
    plan_mod.save(plan_mod.Plan(fingerprint=fp, llamacpp={}, engines={
        file_fingerprint(model): {"engine": engine, "why": "written by the test"}}), path)


def test_auto_follows_the_plan_and_says_why_it_did_not(tiny, tmp_path):
    plan = tmp_path / "plan.json"
    auto = EngineConfig(engine="auto", plan=str(plan))
    assert engine_choice.resolve(EngineConfig(engine="torch"), tiny) == (EngineConfig(engine="torch"), None)
    cfg, chosen = engine_choice.resolve(auto, tiny)
    assert cfg.engine == "llamacpp" and chosen.by == "default" and "no tuned plan" in chosen.reason
    write_plan(plan, tiny, "torch")
    cfg, chosen = engine_choice.resolve(auto, tiny)
    assert (cfg.engine, chosen.by, chosen.reason) == ("torch", "plan", f"{plan}: written by the test")
    # a setting only llama.cpp has keeps llama.cpp, saying so
    cfg, chosen = engine_choice.resolve(dataclasses.replace(auto, kv_type="q8_0"), tiny)
    assert cfg.engine == "llamacpp" and chosen.by == "fallback" and "--kv-type q8_0 is llama.cpp's" in chosen.reason
    # another model: not measured
    other = write_tiny_llama(tmp_path / "other.gguf", n_layer=3)
    assert "did not measure the engines on this model" in engine_choice.resolve(auto, other)[1].reason
    # a plan from another build is not used
    doc = json.loads(plan.read_text())
    doc["fingerprint"]["appliance"] = "0.0.0-other"
    plan.write_text(json.dumps(doc))
    assert "not this machine's" in engine_choice.resolve(auto, tiny)[1].reason


def test_a_torch_runner_that_refuses_the_model_falls_back_to_llama_cpp(tiny, tmp_path, monkeypatch):
    from appliance.engine import startup
    from appliance.models import resolve

    plan = tmp_path / "plan.json"
    write_plan(plan, tiny, "torch")
    real = startup.make_runner

    def refusing(cfg, path, alias, defer_kernels=False):
        if cfg.engine == "torch":
            raise ModelLoadError("this architecture is not one the torch runner runs")
        return real(cfg, path, alias, defer_kernels)

    monkeypatch.setattr(startup, "make_runner", refusing)
    cfg, runner, chosen, _ = startup._runner(EngineConfig(engine="auto", plan=str(plan), n_slots=1, n_ctx=256),
                                             resolve(str(tiny)))
    try:
        assert cfg.engine == "llamacpp" and "llama_cpp_python" in runner.info.settings
        assert chosen.by == "fallback" and "not one the torch runner runs" in chosen.reason
    finally:
        runner.close()


def test_tune_measures_both_engines_and_serve_follows_the_plan(tiny, tmp_path):
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "appliance", "tune", "--model", str(tiny), "--engines",
                           "llamacpp,torch", "--depths", "32,96", "--n-ctx", "128", "--n-slots", "1", "--runs", "1",
                           "--tokens", "4", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "and the torch runner" in done.stderr and "## Engine for tiny.gguf:" in done.stdout
    entry = json.loads(out.read_text())["engines"][file_fingerprint(tiny)]
    assert entry["engine"] in ("llamacpp", "torch") and entry["engine"] in done.stdout.split("## Engine for")[1]
    for d in ("32", "96"):
        both = entry["measured"][d]
        assert both["llamacpp"]["score_s"] > 0 and both["torch"]["score_s"] > 0 and both["torch"]["runs"] == 1
        # each measured with the speculation serve would run on it: the torch runner's verify is exact
        spec = both["torch"]["speculation"]
        assert spec["mode"] == "lookup" and spec["reason"] == "the runner verifies k tokens exactly as k steps"
        assert both["llamacpp"]["speculation"]["mode"] in ("lookup", "off")
    assert "| depth | engine | speculation |" in done.stdout
    # and llama.cpp's winner waiting passively against spinning, for --thread-wait auto
    wait = json.loads(out.read_text())["thread_wait"][file_fingerprint(tiny)]
    assert wait["thread_wait"] in ("spin", "passive") and f"## Thread wait for tiny.gguf: {wait['thread_wait']}" in done.stdout
    assert set(wait["measured"]["96"]) == {"spin", "passive"}
    with running_server(tmp_path, "--model", str(tiny), "--engine", "auto", "--n-ctx", "128", "--n-slots", "1",
                        "--plan", str(out)) as server:
        settings = requests.get(server.url + "/health", timeout=10).json()["settings"]
    assert settings["engine_choice"]["engine"] == entry["engine"] and settings["engine_choice"]["by"] == "plan"
    assert settings["thread_wait"] == wait["thread_wait"]
    assert ("torch" in settings) == (entry["engine"] == "torch")
    assert ("llama_cpp_python" in settings) == (entry["engine"] == "llamacpp")
