"""--embedding-model chat, one real server: the chat model answers embeddings with its mean-pooled
last hidden state (a second llama.cpp context on the same weights), the same vectors as
llama-cpp-python's `Llama.embed` with mean pooling, whatever model name the client sends (one
model is served); llama-server's /embeddings answers the pooled vector in its shape, under each
embd_normalize; usage.prompt_tokens counts as chat's does; and a long embeddings request does not
hold generation: the engine runs one embeddings batch per turn between scheduler steps."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import requests

from tests.engine.gguf_fixtures import write_tiny_llama

from .conftest import running_server, wait_until

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a"]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    # a tokenizer that adds its BOS (SmolLM2's adds none): what prompt_tokens counts shows
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-chat.gguf", add_bos=True)


@pytest.fixture(scope="module")
def server(chat_file, tmp_path_factory):
    # batches of 64 tokens: many engine turns for a test's worth of inputs
    with running_server(tmp_path_factory.mktemp("embed-chat"), "--model", str(chat_file), "--embedding-model", "chat",
                        "--n-threads", "1", "--n-ctx", "512", "--n-slots", "2", "--speculate", "off",
                        "--n-batch", "64", "--prefill-chunk", "64") as srv:
        yield srv


def embed(server, body: dict) -> dict:
    r = requests.post(server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_chat_model_embeds_with_its_mean_pooled_hidden_state(server, chat_file):
    import llama_cpp

    llm = llama_cpp.Llama(str(chat_file), embedding=True, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
    ref = np.array(llm.embed(TEXTS, normalize=True))
    llm.close()
    got = embed(server, {"input": TEXTS})            # no model: the default (chat) model
    assert got["model"] == "tiny-chat"
    assert np.abs(np.array([d["embedding"] for d in got["data"]]) - ref).max() < 1e-5
    assert server.health()["settings"]["embeddings"]["pooling"] == "mean"


def test_any_model_name_reaches_the_one_model(server):
    named = embed(server, {"input": TEXTS, "model": "text-embedding-3-small"})
    assert named["model"] == "tiny-chat" and named["data"] == embed(server, {"input": TEXTS})["data"]


def test_llama_servers_embeddings_are_the_pooled_vector_under_each_norm(server):
    raw = requests.post(server.url + "/embeddings", json={"content": TEXTS, "embd_normalize": -1}, timeout=60).json()
    assert [d["index"] for d in raw] == [0, 1, 2] and all(len(d["embedding"]) == 1 for d in raw)
    vecs = np.array([d["embedding"][0] for d in raw])
    assert np.abs(np.linalg.norm(vecs, axis=1) - 1).min() > 1e-3                  # -1: not normalised
    norms = {2: np.linalg.norm(vecs, axis=1), 1: np.abs(vecs).sum(axis=1), 0: np.abs(vecs).max(axis=1) / 32760,
             3: (np.abs(vecs) ** 3).sum(axis=1) ** (1 / 3)}          # llama.cpp's common_embd_normalize
    for p, norm in norms.items():
        got = requests.post(server.url + "/embedding", json={"input": TEXTS, "embd_normalize": p}, timeout=60).json()
        np.testing.assert_allclose([d["embedding"][0] for d in got], vecs / norm[:, None], rtol=1e-5, atol=1e-6)
    l2 = embed(server, {"input": TEXTS})["data"]
    assert np.abs(np.array([d["embedding"] for d in l2]) - vecs / norms[2][:, None]).max() < 1e-6


def test_prompt_tokens_count_as_chats_do(server):
    for text in TEXTS:
        n, plain = (len(requests.post(server.url + "/tokenize", json={"content": text, "add_special": special},
                                      timeout=30).json()["tokens"]) for special in (True, False))
        assert n == plain + 1                                       # the BOS the tokenizer adds
        completion = requests.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1},
                                   timeout=60).json()
        assert embed(server, {"input": text})["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"] == n


def test_a_long_embeddings_request_does_not_hold_generation(server):
    # 180 inputs of 19 tokens (BOS, 3 digits, 15 words): 60 batches of 3 inputs, each one turn of the
    # engine; the reply needs its prefill and 8 decode steps
    inputs = [f"{i:03d}" + " word" * 15 for i in range(180)]
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(embed(server, {"input": inputs})))
    t.start()
    assert wait_until(lambda: server.health()["in_flight"] >= 1, timeout=30)
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert t.is_alive()                             # the chat reply came while the embeddings went on
    t.join(300)
    assert len(done["data"]) == 180 and done["usage"]["prompt_tokens"] == 180 * 19


def test_ollama_embed_names_the_chat_model(server):
    r = requests.post(server.url + "/api/embed", json={"model": "tiny-chat", "input": TEXTS}, timeout=60)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 3
