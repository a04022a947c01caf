"""The runners every runner-level test runs against: llama.cpp always, torch where installed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from appliance.config import EngineConfig

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

KINDS = ["llamacpp", pytest.param("torch", marks=needs_torch)]


def make_runner(kind: str, cfg: EngineConfig, path: Path | str, name: str = "test"):
    from appliance.engine.runners import make_runner as make

    return make(EngineConfig(**{**cfg.__dict__, "engine": kind}), Path(path), name)
