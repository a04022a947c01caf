"""ModelPool.resolve, the one rule for a request's model name (nothing is loaded here): a served
name or file name, any name with one model served, the default under --default-model-fallback,
else a 404 naming the served models; `exact` routes refuse any other name."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from appliance import config
from appliance.engine.pool import ModelPool
from appliance.errors import ModelNotFound
from appliance.library.catalog import ModelSpec


@contextlib.contextmanager
def pool_of(*names: str, aliases: dict[str, tuple[str, ...]] | None = None, **flags: str):
    specs = [ModelSpec(n, Path(f"/models/{n}.gguf"), "file", aliases=(aliases or {}).get(n, ())) for n in names]
    pool = ModelPool(specs, names[0], config.load(flags, env={}))
    try:
        yield pool
    finally:
        pool.close()


def test_one_model_answers_any_name():
    with pool_of("qwen") as pool:
        assert [pool.resolve(m) for m in ("qwen", "qwen.gguf", None, "gpt-4o-mini", "")] == ["qwen"] * 5
        with pytest.raises(ModelNotFound, match="'gpt-4o-mini' does not exist; this server serves qwen"):
            pool.resolve("gpt-4o-mini", exact=True)


def test_several_models_name_themselves_in_the_404():
    with pool_of("qwen", "llama", "phi") as pool:
        assert pool.resolve("llama") == "llama" and pool.resolve("phi.gguf") == "phi" and pool.resolve(None) == "qwen"
        with pytest.raises(ModelNotFound, match="this server serves qwen, llama, phi") as ei:
            pool.resolve("gpt-4o-mini")
        assert ei.value.status == 404 and ei.value.param == "model"


def test_default_model_fallback_routes_unknown_names_to_the_default():
    with pool_of("qwen", "llama", default_model_fallback="1") as pool:
        assert pool.resolve("gpt-3.5-turbo") == "qwen" and pool.resolve("llama") == "llama"
        with pytest.raises(ModelNotFound):
            pool.resolve("gpt-3.5-turbo", exact=True)


def test_every_model_alias_reaches_its_model_and_a_models_own_name_wins():
    with pool_of("qwen", "llama", aliases={"qwen": ("qwen", "coder", "llama")}) as pool:
        assert [pool.resolve(m, exact=True) for m in ("qwen", "coder", "llama")] == ["qwen", "qwen", "llama"]
        with pytest.raises(ModelNotFound):
            pool.resolve("gpt-4o-mini")
