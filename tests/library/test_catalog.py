"""What `serve` serves without --model, and each model's settings (no server started)."""
from __future__ import annotations

import logging

import pytest

from appliance import config
from appliance.library.catalog import catalog, load_settings
from appliance.library.index import Library
from appliance.models import EMBEDDED_ALIAS
from tests.engine.gguf_fixtures import write_garbage, write_tiny_llama


@pytest.fixture
def lib(tmp_path):
    root = tmp_path / "lib"
    (root / "x").mkdir(parents=True)
    Library(root).add("tiny", [write_tiny_llama(root / "x" / "tiny.gguf")], "hf:x/y", {"repo": "x/y"})
    (root / "settings.toml").write_text('["tiny"]\nn_ctx = 4096\nkv_type = "q8_0"\n')
    return root


def test_embedded_library_and_dirs_with_their_settings(lib, tmp_path):
    more = tmp_path / "more"
    more.mkdir()
    write_tiny_llama(more / "other.gguf", seed=5)
    write_garbage(more / "junk.gguf")                      # listed by `models`, never served
    cfg = config.load({"library": str(lib), "models_dir": str(more)}, env={})
    specs, default = catalog(cfg)
    assert [s.name for s in specs] == [EMBEDDED_ALIAS, "tiny", "other"] and default == EMBEDDED_ALIAS
    tiny = specs[1].engine_config(cfg, default=False)
    assert (tiny.n_ctx, tiny.kv_type, tiny.model_alias) == (4096, "q8_0", "tiny")
    assert tiny.cache_dir.endswith("prompt-cache/models/tiny")
    assert specs[0].engine_config(cfg, default=True).cache_dir is None


def test_a_flag_or_variable_given_to_serve_wins_over_the_file(lib):
    for cfg in (config.load({"library": str(lib), "n_ctx": "1024"}, env={}),
                config.load({"library": str(lib)}, env={"APPLIANCE_N_CTX": "1024"})):
        specs, _ = catalog(cfg)
        tiny = next(s for s in specs if s.name == "tiny").engine_config(cfg, False)
        assert (tiny.n_ctx, tiny.kv_type) == (1024, "q8_0")


def test_a_models_table_is_given_too_so_serves_defaults_follow_it(lib, caplog):
    (lib / "settings.toml").write_text('["tiny"]\nn_batch = 32\n')
    cfg = config.load({"library": str(lib)}, env={})
    with caplog.at_level(logging.INFO, logger="appliance.library"):
        specs, _ = catalog(cfg)
    tiny = next(s for s in specs if s.name == "tiny").engine_config(cfg, False)
    assert (tiny.n_batch, tiny.prefill_chunk, tiny.n_ubatch) == (32, 32, 32)
    assert "[tiny]: prefill_chunk follows --n-batch: 32" in caplog.text
    with pytest.raises(ValueError, match=r"\[tiny\]: --prefill-chunk 64 is larger than --n-batch 32"):
        catalog(config.load({"library": str(lib), "prefill_chunk": "64"}, env={}))


def test_model_serves_that_file_alone(lib):
    path = lib / "x" / "tiny.gguf"
    specs, default = catalog(config.load({"model": str(path), "library": str(lib)}, env={}))
    assert [(s.name, s.path) for s in specs] == [("tiny", path)] and default == "tiny"


def test_model_alias_names_the_model_first_and_tags_go_with_it(lib):
    path = lib / "x" / "tiny.gguf"
    specs, default = catalog(config.load({"model": str(path), "model_alias": "coder, tiny-2,coder",
                                          "tags": "local,small"}, env={}))
    assert [(s.name, s.aliases, s.tags) for s in specs] == [("coder", ("coder", "tiny-2"), ("local", "small"))]
    assert default == "coder" and specs[0].engine_config(config.load({}, env={}), True).model_alias == "coder"
    # without --model they name the embedded model; the library's keep their own names
    specs, _ = catalog(config.load({"library": str(lib), "model_alias": "a,b"}, env={}))
    assert [(s.name, s.aliases) for s in specs] == [("a", ("a", "b")), ("tiny", ())]
    for flags in ({"model_alias": "a,,b"}, {"tags": "x,"}):
        with pytest.raises(ValueError, match="a name is empty"):
            config.load(flags, env={})


def test_settings_mistakes_name_the_file_model_and_key(lib):
    (lib / "settings.toml").write_text('["tiny"]\nn_ctxx = 4096\n')
    with pytest.raises(ValueError, match=r"settings.toml: \[tiny\] n_ctxx: not a model setting"):
        load_settings(lib)
    (lib / "settings.toml").write_text('["tiny"]\nkv_type = "q3"\n')
    with pytest.raises(ValueError, match=r"\[tiny\]: kv_type must be"):
        catalog(config.load({"library": str(lib)}, env={}))
    (lib / "settings.toml").write_text('["tiny"\n')
    with pytest.raises(ValueError, match="settings.toml"):
        load_settings(lib)
    with pytest.raises(ValueError, match="--default-model nope: no such model"):
        (lib / "settings.toml").unlink()
        catalog(config.load({"library": str(lib), "default_model": "nope"}, env={}))


def test_serves_chat_template_is_the_default_models_and_settings_give_the_others(lib):
    (lib / "settings.toml").write_text('["tiny"]\nchat_template = "gemma"\n')
    cfg = config.load({"library": str(lib), "chat_template": "chatml", "chat_template_kwargs": '{"a": 1}'}, env={})
    specs, default = catalog(cfg)
    embedded = next(s for s in specs if s.name == default).engine_config(cfg, default=True)
    tiny = next(s for s in specs if s.name == "tiny").engine_config(cfg, default=False)
    assert (embedded.chat_template, embedded.chat_template_kwargs) == ("chatml", '{"a": 1}')
    assert (tiny.chat_template, tiny.chat_template_kwargs) == ("gemma", None)
    (lib / "settings.toml").write_text('["tiny"]\nchat_template = "gemma2"\n')    # refused at start, named
    with pytest.raises(ValueError, match=r"\[tiny\]: chat template 'gemma2' is neither a built-in one"):
        catalog(cfg)


def test_a_models_dir_model_alone_in_its_folder_takes_the_projector_beside_it(lib, tmp_path):
    from tests.engine.mmproj_fixture import write_mmproj

    more = tmp_path / "more"
    (more / "seeing").mkdir(parents=True)
    write_tiny_llama(more / "seeing" / "eyes.gguf", seed=6)
    write_mmproj(more / "seeing" / "mmproj-eyes-F16.gguf")
    write_tiny_llama(more / "flat.gguf", seed=7)           # a flat folder: whose projector would it be?
    write_mmproj(more / "mmproj-flat.gguf")
    cfg = config.load({"library": str(lib), "models_dir": str(more)}, env={})
    specs = {s.name: s for s in catalog(cfg)[0]}
    assert specs["eyes"].engine_config(cfg, default=False).mmproj == str(more / "seeing" / "mmproj-eyes-F16.gguf")
    assert specs["flat"].engine_config(cfg, default=False).mmproj is None
    (lib / "settings.toml").write_text('["eyes"]\nmmproj = "/elsewhere/mmproj.gguf"\n')   # the file wins
    specs = {s.name: s for s in catalog(cfg)[0]}
    assert specs["eyes"].engine_config(cfg, default=False).mmproj == "/elsewhere/mmproj.gguf"
