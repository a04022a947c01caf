"""Configuration: defaults < APPLIANCE_* env < flags, typed parsing, and --help coverage."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from appliance import config
from appliance.cli import build_parser
from appliance.compute_settings import LlamaCppSettings
from appliance.config import Config, EngineConfig, ServerConfig


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def flags_of(argv: list[str]) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    d = vars(args)
    d.pop("func"), d.pop("command")
    return d


def test_defaults_with_empty_env():
    cfg = config.load({}, env={})
    assert cfg == Config()
    assert cfg.engine.n_ctx == 8192 and cfg.engine.n_slots == 4 and cfg.engine.model is None
    assert cfg.engine.flash_attn is False
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8080
    assert cfg.server.api_key is None and cfg.server.engine_start_timeout == 300.0


def test_unrelated_env_is_ignored():
    cfg = config.load({}, env={"N_SLOTS": "9", "APPLIANCE": "x", "PORT": "1"})
    assert cfg == Config()


def test_env_overrides_defaults_with_types():
    env = {"APPLIANCE_N_SLOTS": "8", "APPLIANCE_PORT": "9000", "APPLIANCE_SHUTDOWN_GRACE": "2.5",
           "APPLIANCE_API_KEY": "sekret", "APPLIANCE_MODEL": "/m/x.gguf"}
    cfg = config.load({}, env=env)
    assert cfg.engine.n_slots == 8 and isinstance(cfg.engine.n_slots, int)
    assert cfg.server.port == 9000
    assert cfg.server.shutdown_grace == 2.5 and isinstance(cfg.server.shutdown_grace, float)
    assert cfg.server.api_key == "sekret"
    assert cfg.engine.model == "/m/x.gguf"
    assert cfg.engine.n_ctx == 8192  # untouched


def test_load_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("APPLIANCE_N_CTX", "1024")
    assert config.load({}).engine.n_ctx == 1024


def test_flags_override_env():
    env = {"APPLIANCE_N_SLOTS": "8", "APPLIANCE_HOST": "0.0.0.0", "APPLIANCE_FLASH_ATTN": "1"}
    flags = flags_of(["--n-slots", "2", "--no-flash-attn"])
    cfg = config.load(flags, env=env)
    assert cfg.engine.n_slots == 2
    assert cfg.engine.flash_attn is False
    assert cfg.server.host == "0.0.0.0"  # not given as a flag: env still applies


def test_flags_not_given_are_none_so_env_applies():
    flags = flags_of([])
    assert all(v is None for v in flags.values())
    assert config.load(flags, env={"APPLIANCE_SEED": "7"}).engine.seed == 7


def test_flag_values_are_parsed():
    cfg = config.load(flags_of(["--port", "1234", "--engine-start-timeout", "9.5", "--flash-attn"]),
                      env={})
    assert cfg.server.port == 1234 and cfg.server.engine_start_timeout == 9.5
    assert cfg.engine.flash_attn is True


@pytest.mark.parametrize("raw,want", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("OFF", False),
])
def test_bool_from_env(raw, want):
    assert config.load({}, env={"APPLIANCE_FLASH_ATTN": raw}).engine.flash_attn is want


@pytest.mark.parametrize("name,raw", [
    ("APPLIANCE_FLASH_ATTN", "maybe"),
    ("APPLIANCE_N_SLOTS", "four"),
    ("APPLIANCE_N_CTX", "1.5"),
    ("APPLIANCE_SHUTDOWN_GRACE", "soon"),
    ("APPLIANCE_PORT", ""),
])
def test_bad_env_value_names_the_variable(name, raw):
    with pytest.raises(ValueError, match=re.escape(name)):
        config.load({}, env={name: raw})


def test_bad_flag_value_raises_value_error():
    with pytest.raises(ValueError, match="N_SLOTS"):
        config.load(flags_of(["--n-slots", "x"]), env={})


def test_config_is_frozen():
    cfg = config.load({}, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.n_slots = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine = EngineConfig()  # type: ignore[misc]


def test_every_field_is_a_flag_with_its_env_name(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # keep each help entry on predictable lines
    help_text = serve_parser().format_help()
    flat = " ".join(help_text.split())
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = "APPLIANCE_" + f.name.upper()
            assert re.search(re.escape(flag) + r"(?![\w-])", help_text), flag
            assert f"env {env};" in flat, env


def test_every_field_parses_from_its_flag():
    parser = serve_parser()
    dests = {a.dest for a in parser._actions}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert f.name in dests, f.name


def test_serve_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["serve", "--help"])
    assert ei.value.code == 0
    assert "--n-slots" in capsys.readouterr().out


@pytest.mark.parametrize("argv, env, mode", [
    ([], {}, "on"), (["--prompt-cache"], {}, "on"), (["--prompt-cache", "fast"], {}, "fast"),
    (["--no-prompt-cache"], {}, "off"), (["--prompt-cache", "off"], {}, "off"),
    ([], {"APPLIANCE_PROMPT_CACHE": "0"}, "off"), ([], {"APPLIANCE_PROMPT_CACHE": "Fast"}, "fast"),
    (["--prompt-cache", "on"], {"APPLIANCE_PROMPT_CACHE": "false"}, "on")])
def test_prompt_cache_is_a_mode_and_a_switch(argv, env, mode):
    cfg = config.load(flags_of(argv), env=env).engine
    assert cfg.prompt_cache == mode and cfg.prompt_cache_on == (mode != "off")


def test_prompt_cache_modes_and_the_old_booleans():
    assert EngineConfig(prompt_cache=False).prompt_cache == "off" and EngineConfig(prompt_cache=True).prompt_cache == "on"
    with pytest.raises(ValueError, match="on, off or fast"):
        config.load(flags_of(["--prompt-cache", "sometimes"]), env={})


@pytest.mark.parametrize("flags", [{"n_slots": "0"}, {"prefill_chunk": "1024", "n_batch": "512"},
                                   {"port": "70000"}, {"log_level": "loud"}])
def test_invalid_settings_are_refused(flags):
    with pytest.raises(ValueError):
        config.load(flags, env={})


def test_kv_unified_is_a_llamacpp_switch():
    assert config.load(flags_of(["--kv-unified"]), env={}).engine.kv_unified
    assert not config.load(flags_of([]), env={}).engine.kv_unified
    with pytest.raises(ValueError, match="--kv-type and --kv-unified apply to the llama.cpp runner only"):
        config.load(flags_of(["--kv-unified", "--engine", "torch"]), env={})


@pytest.mark.parametrize("argv,env", [(["--n-batch", "32"], {}), ([], {"APPLIANCE_N_BATCH": "32"})])
def test_defaults_follow_a_smaller_n_batch_given_by_flag_or_variable(argv, env):
    cfg = config.load(flags_of(argv), env=env)
    assert (cfg.engine.n_batch, cfg.engine.prefill_chunk, cfg.engine.n_ubatch) == (32, 32, 32)
    assert cfg.adjusted == ("prefill_chunk follows --n-batch: 32", "n_ubatch follows --n-batch: 32")
    assert "n_batch" in cfg.given and "prefill_chunk" not in cfg.given


@pytest.mark.parametrize("argv,follows", [(["--prefill-chunk", "1024"], "n_batch follows --prefill-chunk: 1024"),
                                          (["--n-ubatch", "1024"], "n_batch follows --n-ubatch: 1024")])
def test_n_batch_left_at_its_default_grows_to_what_was_given(argv, follows):
    cfg = config.load(flags_of(argv), env={})
    assert cfg.engine.n_batch == 1024 and cfg.adjusted == (follows,)
    assert config.load(flags_of(["--n-batch", "1024", *argv]), env={}).adjusted == ()


@pytest.mark.parametrize("argv,env,flags", [
    (["--n-batch", "32", "--prefill-chunk", "64"], {}, ("--prefill-chunk 64", "--n-batch 32")),
    (["--prefill-chunk", "512"], {"APPLIANCE_N_BATCH": "32"}, ("--prefill-chunk 512", "--n-batch 32")),
    ([], {"APPLIANCE_N_BATCH": "256", "APPLIANCE_N_UBATCH": "512"}, ("--n-ubatch 512", "--n-batch 256")),
])
def test_two_given_settings_that_contradict_are_refused_naming_both(argv, env, flags):
    with pytest.raises(ValueError) as ei:
        config.load(flags_of(argv), env=env)
    assert all(f in str(ei.value) for f in flags), ei.value


def test_a_tuned_plans_batch_is_no_given_setting_either():
    from appliance.engine.plan import fill_defaults

    chosen = LlamaCppSettings(n_threads=2, n_threads_batch=2, n_batch=256, n_ubatch=256, flash_attn=False)
    small = fill_defaults(config.load(flags_of(["--n-batch", "32"]), env={}).engine, chosen)
    assert (small.n_batch, small.n_ubatch, small.prefill_chunk) == (32, 32, 32)
    large = fill_defaults(config.load(flags_of(["--prefill-chunk", "1024"]), env={}).engine, chosen)
    assert (large.n_batch, large.n_ubatch, large.prefill_chunk) == (1024, 256, 1024)
    assert fill_defaults(EngineConfig(), chosen).n_batch == 512      # the default chunk: the plan's batch follows it


def test_llamacpp_settings_resolve_threads_and_clamp_the_micro_batch(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 6)
    assert EngineConfig().llamacpp() == LlamaCppSettings(6, 6, 512, 512, False)
    assert EngineConfig(n_threads=3, n_threads_batch=5, n_batch=256, n_ubatch=1024, prefill_chunk=256,
                        flash_attn=True).llamacpp() == LlamaCppSettings(3, 5, 256, 256, True)


def test_llamacpp_settings_round_trip_through_a_dict_and_the_config():
    s = LlamaCppSettings(n_threads=2, n_threads_batch=4, n_batch=1024, n_ubatch=256, flash_attn=True)
    health = {**s.as_dict(), "kv_type": "f16", "prefill_chunk": 512}     # /health: more keys
    assert LlamaCppSettings.from_mapping(health) == s
    assert list(s.as_dict()) == ["n_threads", "n_threads_batch", "n_batch", "n_ubatch", "flash_attn"]
    cfg = EngineConfig(n_ctx=2048).with_llamacpp(s)
    assert cfg.llamacpp() == s and cfg.n_ctx == 2048 and cfg.n_threads_batch == 4
    with pytest.raises(ValueError):
        LlamaCppSettings(0, 1, 512, 512, False)


def test_chat_template_flags_and_variables():
    cfg = config.load(flags_of(["--chat-template", "llama3", "--chat-template-kwargs", '{"enable_thinking": false}']),
                      env={})
    assert cfg.engine.template_override()[0] == "builtin:llama3"
    assert cfg.engine.template_kwargs() == {"enable_thinking": False}
    env = config.load({}, env={"APPLIANCE_CHAT_TEMPLATE": "gemma", "APPLIANCE_CHAT_TEMPLATE_KWARGS": '{"x": [1]}'})
    assert env.engine.template_override()[0] == "builtin:gemma" and env.engine.template_kwargs() == {"x": [1]}
    assert EngineConfig().template_override() is None and EngineConfig().template_kwargs() == {}


@pytest.mark.parametrize("flags,message", [
    ({"chat_template": "no-such-template"}, "neither a built-in one (bailing, bailing-think, bailing2, chatglm3"),
    ({"chat_template_kwargs": "{nope"}, "chat_template_kwargs is not JSON"),
    ({"chat_template_kwargs": "[1, 2]"}, "chat_template_kwargs must be a JSON object"),
    ({"chat_template_kwargs": '{"messages": []}'}, "may not set messages"),
])
def test_a_wrong_chat_template_setting_refuses_to_start(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config.load(flags, env={})


@pytest.mark.parametrize("host,hosts,loopback", [
    ("127.0.0.1", ("127.0.0.1",), True),
    ("127.0.0.1,::1", ("127.0.0.1", "::1"), True),
    (" localhost , [::1] ", ("localhost", "::1"), True),
    ("127.0.0.1,0.0.0.0", ("127.0.0.1", "0.0.0.0"), False),
    ("::", ("::",), False),
    ("192.168.1.5", ("192.168.1.5",), False),
])
def test_host_takes_several_addresses(host, hosts, loopback):
    srv = config.load({"host": host}, env={}).server
    assert srv.hosts() == hosts and srv.loopback_only() is loopback


def test_host_must_name_an_address():
    with pytest.raises(ValueError, match="host must name at least one address"):
        config.load({"host": " , "}, env={})
