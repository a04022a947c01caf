"""Embeddings end to end with an embedding model (--embedding-model PATH) beside a chat model, one
real server: the official `openai` SDK (float, base64, and its default, which asks for base64 and
decodes it; any model name), the `ollama` client (/api/embed and the older /api/embeddings),
llama-server's /embeddings (a vector per token: the server pools none, --pooling none over the
GGUF's mean), vectors against llama-cpp-python's own mean-pooled `Llama.embed` on the same file
(OpenAI's and Ollama's routes answer the mean of the token vectors), mixed text and token-id
inputs, and bad inputs answered in each API's error shape, word for word where clients match."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import requests

from tests.engine.gguf_fixtures import write_tiny, write_tiny_llama

from .conftest import running_server

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a", "Ünïcödé 🙂 " * 4]
EMB, CHAT = "tiny-embed", "tiny-chat"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return write_tiny(d / f"{EMB}.gguf", "llama", pooling="mean"), write_tiny_llama(d / f"{CHAT}.gguf")


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    emb, chat = files
    # one thread: llama.cpp's threads spin at every barrier and crawl beside other busy processes
    with running_server(tmp_path_factory.mktemp("embed"), "--model", str(chat), "--embedding-model", str(emb),
                        "--pooling", "none", "--n-threads", "1", "--n-ctx", "512", "--n-slots", "1",
                        "--speculate", "off") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(files):
    import llama_cpp

    llm = llama_cpp.Llama(str(files[0]), embedding=True, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                          verbose=False)
    yield np.array(llm.embed(TEXTS, normalize=True)), [len(llm.tokenize(t.encode())) for t in TEXTS]
    llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def as_array(resp) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def test_openai_float_vectors_are_llama_cpps_normalised(client, reference):
    ref, n_tokens = reference
    resp = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float", user="someone")
    assert resp.object == "list" and resp.model == EMB and [d.index for d in resp.data] == [0, 1, 2, 3]
    assert all(d.object == "embedding" for d in resp.data)
    assert np.abs(as_array(resp) - ref).max() < 1e-5
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(n_tokens)


def test_base64_is_the_same_little_endian_float32(client):
    floats = as_array(client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float"))
    raw = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    assert np.array_equal(decoded, floats)
    assert np.array_equal(as_array(client.embeddings.create(model=EMB, input=TEXTS)), floats)  # the SDK's default


def test_no_model_or_an_unknown_one_gets_the_embedding_model(client, server):
    one = as_array(client.embeddings.create(model="text-embedding-3-small", input="hello world"))
    assert np.array_equal(as_array(client.embeddings.create(model="text-embedding-ada-002", input="hello world")), one)
    got = requests.post(server.url + "/v1/embeddings", json={"input": "hello world"}, timeout=30).json()
    assert got["model"] == EMB and np.array_equal(np.array([got["data"][0]["embedding"]]), one)


def tokens(server, text: str) -> list[int]:
    """`text`'s tokens with the specials the tokenizer adds (the two models share SmolLM2's)."""
    return requests.post(server.url + "/tokenize", json={"content": text, "model": CHAT, "add_special": True},
                         timeout=30).json()["tokens"]


def test_llama_servers_embeddings_are_a_vector_per_token_unnormalised(client, server):
    n = [len(tokens(server, t)) for t in TEXTS[:2]]
    got = requests.post(server.url + "/embeddings", json={"input": TEXTS[:2]}, timeout=30).json()
    assert [d["index"] for d in got] == [0, 1] and [len(d["embedding"]) for d in got] == n
    rows = [np.array(d["embedding"]) for d in got]
    assert all(r.shape[1] == 64 for r in rows) and abs(np.linalg.norm(rows[0][0]) - 1) > 1e-3
    assert {m["name"]: m.get("embeddings", {}).get("pooling") for m in server.health()["models"]}[EMB] == "none"
    means = np.array([r.mean(axis=0) for r in rows])
    pooled = as_array(client.embeddings.create(model=EMB, input=TEXTS[:2], encoding_format="float"))
    assert np.abs(means / np.linalg.norm(means, axis=1, keepdims=True) - pooled).max() < 1e-5
    # the older path, `content`, and embd_normalize (ignored with no pooling, as llama-server does)
    for path, body in (("/embedding", {"content": TEXTS[:2]}),
                       ("/embeddings", {"input": TEXTS[:2], "embd_normalize": 1})):
        again = requests.post(server.url + path, json=body, timeout=30).json()
        assert all(np.abs(np.array(a["embedding"]) - r).max() < 1e-6 for a, r in zip(again, rows))


def test_text_and_token_ids_mixed_are_the_texts_tokens(client, server):
    text = TEXTS[1]                                   # "The quick brown fox ..."
    head, n = tokens(server, "The quick"), len(tokens(server, text))
    whole = client.embeddings.create(model=EMB, input=text, encoding_format="float")
    mixed = client.embeddings.create(model=EMB, input=[*head, text[len("The quick"):]], encoding_format="float")
    assert whole.usage.prompt_tokens == mixed.usage.prompt_tokens == n
    assert np.abs(as_array(mixed) - as_array(whole)).max() < 1e-6
    # a list of inputs, one of them mixed; llama-server's route the same
    two = requests.post(server.url + "/embeddings", json={"content": ["hello world", [*head, text[len("The quick"):]]]},
                        timeout=30).json()
    assert [len(d["embedding"]) for d in two] == [len(tokens(server, "hello world")), n]


def test_token_ids_and_lists_of_them(client, server, reference):
    ref, _ = reference       # the two models share SmolLM2's tokenizer; the embedding model does not tokenize
    ids = requests.post(server.url + "/tokenize", json={"content": TEXTS[1], "model": CHAT},
                        timeout=30).json()["tokens"]
    single = as_array(client.embeddings.create(model=EMB, input=ids))
    several = as_array(client.embeddings.create(model=EMB, input=[ids, ids[:3]]))
    assert np.abs(single[0] - ref[1]).max() < 1e-5 and np.abs(several[0] - single[0]).max() < 1e-6


def test_dimensions_only_as_the_models_own(client):
    got = client.embeddings.create(model=EMB, input="x", dimensions=64, encoding_format="float")
    assert len(got.data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=EMB, input="x", dimensions=32)
    assert ei.value.body["param"] == "dimensions" and "64 dimensions" in ei.value.body["message"]


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input[0]"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input[1]"),
    ({"input": ["ok", "word " * 600]}, "input[1]"), ({"input": [[5, 10**9]]}, "input[0]"),
    ({"input": [{"text": "x"}]}, "input[0]"), ({}, "input"), ({"input": [["a", "b"]]}, "input[0]"),
    ({"input": "x", "embd_normalize": -2}, "embd_normalize"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "dimensions": "64"}, "dimensions"),
    ({"input": "x", "model": CHAT}, "model"),
])
def test_bad_requests_are_openai_errors_naming_the_parameter(server, body, param):
    r = requests.post(server.url + "/v1/embeddings", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


def too_large(server, i: int, text: str) -> str:
    return (f"input[{i}] ({len(tokens(server, text))} tokens) is too large to process: this model's maximum context "
            "length for an embedding input is 512 tokens; shorten it or send truncate: true to cut it")


def test_an_input_over_the_limit_is_too_large_and_truncate_cuts_it(client, server):
    long = "word " * 600
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=EMB, input=["ok", long])
    err = ei.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "input[1]" and err["n_ctx"] == 512
    assert err["message"] == too_large(server, 1, long)
    r = requests.post(server.url + "/embeddings", json={"content": long}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == too_large(server, 0, long)
    cut = requests.post(server.url + "/v1/embeddings", json={"input": [long], "truncate": True}, timeout=30).json()
    assert cut["usage"]["prompt_tokens"] == 512


def test_chat_on_the_embedding_model_and_embeddings_from_the_chat_model_are_refused(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "is an embedding model" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=CHAT, input="hi")
    assert "--embedding-model chat" in ei.value.body["message"]
    assert client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices


def test_the_models_list_and_health_show_the_embedding_model(client, server):
    assert {m.id for m in client.models.list()} == {EMB, CHAT}
    kinds = {m["name"]: m["kind"] for m in server.health()["models"]}
    assert kinds == {CHAT: "chat", EMB: "embedding"}


def test_ollama_embed_gives_the_openai_vectors(client, server):
    oc = ollama.Client(host=server.url)
    got = oc.embed(model=EMB, input=TEXTS)
    assert got.model == EMB and got.total_duration >= got.load_duration >= 0
    assert got.prompt_eval_count == sum(len(tokens(server, t)) for t in TEXTS)    # usage.prompt_tokens' rule
    floats = as_array(client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float"))
    assert np.array_equal(np.array(got.embeddings, dtype=np.float32), floats.astype(np.float32))
    assert oc.embed(model=EMB + ":latest", input="hello world").embeddings[0] == got.embeddings[0]
    assert oc.embed(model=EMB, input="").embeddings == []          # loads the model, embeds nothing
    legacy = np.array(oc.embeddings(model=EMB, prompt=TEXTS[1]).embedding)
    assert abs(np.linalg.norm(legacy) - 1) > 1e-3                  # not normalised, as Ollama's
    assert np.abs(legacy / np.linalg.norm(legacy) - floats[1]).max() < 1e-5


def test_ollama_errors_are_its_shape(server):
    oc = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as ei:
        oc.embed(model=CHAT, input="hi")
    assert ei.value.status_code == 400 and "does not answer embeddings" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        oc.embed(model="no-such-model", input="hi")
    assert ei.value.status_code == 404
    r = requests.post(server.url + "/api/embed", json={"model": EMB, "input": "word " * 600, "truncate": False},
                      timeout=30)
    assert r.status_code == 400 and r.json() == {"error": too_large(server, 0, "word " * 600)}
    cut = requests.post(server.url + "/api/embed", json={"model": EMB, "input": "word " * 600}, timeout=30).json()
    assert cut["prompt_eval_count"] == 512                        # Ollama truncates by default
