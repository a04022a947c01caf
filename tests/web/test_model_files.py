"""`appliance serve --model FILE`: a generated tiny GGUF is served under its file name, and files
that are not servable GGUF models make `serve` exit non-zero, naming the file."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import date

import pytest
import requests

from appliance.config import EngineConfig
from appliance.engine.chat import ChatTemplate
from appliance.engine.runners.llamacpp import LlamaCppRunner
from appliance.engine.types import ChatMessage

from ..engine.gguf_fixtures import write_garbage, write_tiny_llama
from ..engine.test_templates import LLAMA31
from .conftest import free_port, running_server

N_CTX = 512
FAIL_TIMEOUT_S = 60
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama3.gguf", chat_template=LLAMA31)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv"), "--model", str(tiny), "--n-ctx", str(N_CTX),
                        "--n-slots", "1", "--http-threads", "8", timeout=120) as srv:
        yield srv


def test_models_reports_the_file_stem(server):
    data = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["tiny-llama3"]
    assert data[0]["context_length"] == N_CTX
    assert data[0]["meta"]["arch"] == "llama" and data[0]["meta"]["n_ctx_train"] == 512
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "tiny-llama3"


def test_chat_completion_on_random_weights(server, tiny):
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama3", "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-llama3"
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"
    assert isinstance(body["choices"][0]["message"]["content"], str)  # gibberish: not checked
    # the prompt was rendered with the GGUF's own (Llama 3.1) template: same token count as
    # rendering and tokenizing it here
    runner = LlamaCppRunner(EngineConfig(n_slots=1, n_ctx=256), tiny, "local")
    try:
        info = runner.info
        assert info.chat_template == LLAMA31
        text = ChatTemplate(info.chat_template, info.bos_text, info.eos_text).render(
            [ChatMessage(m["role"], m["content"]) for m in MESSAGES])
        # today's date, as llama-server gives the template (issue 55), not its own 26 Jul 2024
        assert "Cutting Knowledge Date: December 2023\nToday Date: " + date.today().strftime("%d %b %Y") in text
        ids = runner.tokenize(text, add_special=True)
    finally:
        runner.close()
    assert body["usage"]["prompt_tokens"] == len(ids)


# -- files that cannot be served ------------------------------------------------------------------

def serve_and_fail(model: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "appliance", "serve", "--model", model,
                           "--port", str(free_port()), "--n-ctx", "256", "--n-slots", "1"],
                          capture_output=True, text=True, timeout=FAIL_TIMEOUT_S, env=env,
                          cwd=tmp_path)


@pytest.mark.parametrize("kind", ["truncated", "random", "partial"])
def test_unloadable_gguf_makes_serve_exit(kind, tmp_path, tiny):
    path = tmp_path / f"{kind}.gguf"
    if kind == "partial":  # a download cut short: a whole header, tensor data missing
        path.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    else:
        write_garbage(path, kind)
    proc = serve_and_fail(str(path), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # the appliance's own message names the file (llama.cpp's log lines may too)
    assert f"{path.resolve()}: llama.cpp could not load this file" in out, out
    assert "serving" not in proc.stdout  # it never got as far as listening


def test_missing_file_makes_serve_exit(tmp_path):
    path = tmp_path / "nope" / "missing.gguf"
    proc = serve_and_fail(str(path), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert str(path) in out and "no such model file" in out, out


def test_non_gguf_suffix_makes_serve_exit(tmp_path, tiny):
    path = tmp_path / "model.bin"
    path.write_bytes(tiny.read_bytes()[:4096])  # GGUF magic inside, but not named .gguf
    proc = serve_and_fail(str(path), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert str(path) in out and "only GGUF files" in out, out


def test_n_ctx_auto_on_an_unreadable_file_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "random.gguf"
    write_garbage(path, "random")
    proc = subprocess.run([sys.executable, "-m", "appliance", "serve", "--model", str(path), "--n-ctx", "auto",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=FAIL_TIMEOUT_S,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--n-ctx auto cannot size a file that is not a readable GGUF (no GGUF magic" in proc.stderr
