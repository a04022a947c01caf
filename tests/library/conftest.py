"""A fake Hub per test (HF_ENDPOINT), tiny GGUFs written once per session, and a library
directory and Hugging Face home of the test's own."""
from __future__ import annotations

import pytest

from tests.engine.gguf_fixtures import write_tiny, write_tiny_llama

from .fake_hub import FakeHub, HubServer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, bytes]:
    """A one-file model and a three-part split model: {name in the repo: bytes}."""
    d = tmp_path_factory.mktemp("tiny")
    one = write_tiny_llama(d / "one.gguf", chat_template=TEMPLATE).read_bytes()
    first = write_tiny(d / "split.gguf", "llama", n_layer=2, split_max_tensors=8, name="tiny-split")
    parts = sorted(d.glob("split-*-of-*.gguf"))
    assert first == parts[0] and len(parts) >= 3, parts
    return {"one": one, **{p.name.replace("split", "tiny-split"): p.read_bytes() for p in parts}}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    fake = FakeHub()
    server = HubServer(fake)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    server.close()


@pytest.fixture
def library(tmp_path, monkeypatch):
    root = tmp_path / "library"
    monkeypatch.setenv("APPLIANCE_LIBRARY", str(root))
    return root
