"""`--n-ctx auto` (`appliance/fit/auto.py`): the longest context per slot that the planner says
fits, up to the trained context or what the RoPE scaling reaches; parsed from the flag and the
variable, resolved per model by the catalog before anything loads."""
from __future__ import annotations

from dataclasses import replace

import pytest

from appliance import config
from appliance.fit import auto
from appliance.fit.devices import from_snapshot
from appliance.fit.planner import plan
from appliance.fit.shapes import build
from appliance.rope import AUTO_N_CTX, ModelRope


def test_auto_is_parsed_from_the_flag_and_the_variable():
    assert config.load({"n_ctx": "auto"}, env={}).engine.n_ctx == AUTO_N_CTX
    assert config.load({}, env={"APPLIANCE_N_CTX": "AUTO"}).engine.n_ctx == AUTO_N_CTX
    with pytest.raises(ValueError, match="n_ctx must be 0"):
        config.EngineConfig(n_ctx=-2)


def test_the_ceiling_is_the_trained_context_or_what_scaling_reaches():
    plain, yarn_file = ModelRope(n_ctx_train=8192), ModelRope(n_ctx_train=32768, kind="yarn", factor=4.0)
    cfg = config.EngineConfig(n_ctx=AUTO_N_CTX)
    assert auto.ceiling(cfg, plain) == 8192 and auto.ceiling(cfg, yarn_file) == 131072
    assert auto.ceiling(replace(cfg, rope_scaling="yarn", rope_scale=4.0), plain) == 32768
    assert auto.ceiling(replace(cfg, rope_scaling="yarn"), plain) == auto.MAX_AUTO     # the factor follows
    assert auto.ceiling(replace(cfg, rope_scaling="none"), yarn_file) == 32768


@pytest.mark.parametrize("host,kv_type,n_slots", [("desktop", "f16", 4), ("vm", "q8_0", 1), ("apu", "f16", 2)])
def test_auto_is_the_longest_context_that_fits(hosts, host, kv_type, n_slots):
    m, devices = build("Llama-3.1-8B-Q4_K_M"), from_snapshot(hosts[host])
    cfg = config.EngineConfig(n_ctx=AUTO_N_CTX, n_slots=n_slots, kv_type=kv_type, rope_scaling="yarn")
    req = auto.request_of(cfg, m)
    n, note = auto.auto_context(cfg, m, req, devices)
    assert 0 < n <= auto.MAX_AUTO and n % auto.STEP == 0 and f"{n:,} positions per slot" in note
    assert plan(m, replace(req, n_ctx=n), devices).fits
    if n < auto.MAX_AUTO:
        assert not plan(m, replace(req, n_ctx=n + auto.STEP), devices).fits and "limited by memory" in note


def test_nothing_fits_is_refused_with_the_reason(hosts):
    m = build("Llama-3.3-70B-Q4_K_M")
    cfg = config.EngineConfig(n_ctx=AUTO_N_CTX, n_slots=64)
    with pytest.raises(ValueError, match="--n-ctx auto: not even 256 positions"):
        auto.auto_context(cfg, m, auto.request_of(cfg, m), from_snapshot(hosts["vm"]))


def test_the_catalog_resolves_auto_for_each_model(tmp_path):
    from appliance.library.catalog import ModelSpec
    from tests.engine.gguf_fixtures import write_tiny

    path = write_tiny(tmp_path / "m.gguf", "llama", n_ctx=512)
    cfg, notes = ModelSpec("m", path, "file").fit(config.load({"n_ctx": "auto"}, env={}), True)
    assert cfg.n_ctx == 512 and "limited by the ceiling" in notes[-1]      # a tiny model: its trained context


def test_tensor_overrides_are_planned_as_the_load_places_them(hosts):
    """Experts kept on the GPU with --override-tensor leave it less room for KV than the planner's
    own placement (which sends them to host memory): auto plans them where the load puts them,
    so the context it picks fits (found in issue 50: it planned without the overrides and picked
    a context the load could not hold)."""
    m, devices = build("Qwen3-30B-A3B-Q4_K_M"), from_snapshot(hosts["desktop"])
    cfg = config.EngineConfig(n_ctx=AUTO_N_CTX, n_slots=4, n_gpu_layers="all", rope_scaling="yarn")
    pinned = replace(cfg, override_tensor=r"blk\.(0|1|2|3|4|5|6|7)\.ffn_.*_exps\.weight=CUDA0")
    req = auto.request_of(pinned, m)
    assert req.overrides == ((r"blk\.(0|1|2|3|4|5|6|7)\.ffn_.*_exps\.weight", "GPU0"),)
    assert auto.request_of(replace(cfg, override_tensor=r"output\.weight=cpu"), m).overrides == \
        ((r"output\.weight", "CPU"),)
    free, _ = auto.auto_context(cfg, m, auto.request_of(cfg, m), devices)
    n, note = auto.auto_context(pinned, m, req, devices)
    assert 0 < n < free and "limited by memory" in note
    assert plan(m, replace(req, n_ctx=n), devices).fits and not plan(m, replace(req, n_ctx=free), devices).fits
