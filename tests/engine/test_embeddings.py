"""Embeddings in the engine (engine/embed.py over runners/embedding.py): vectors against
llama-cpp-python's own `Llama.embed` on the same tiny GGUF (an independent reference), pooled and
a vector per token (pooling none, from the GGUF or --pooling), a batch equal to one input at a
time, the chat model's mean-pooled hidden state beside generation, the Embedder's packing, order,
mixed text and token-id inputs, norms and refusals over a fake context, and which model answers
(the catalog's --embedding-model, `ModelPool.resolve_embedding`)."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import llama_cpp as L

from appliance import config
from appliance.config import EngineConfig
from appliance.engine.embed import Embedder, normalized
from appliance.engine.pool import ModelPool
from appliance.engine.ipc import Embed
from appliance.engine.runners.base import Span
from appliance.engine.runners.embedding import EmbeddingRunner, for_chat_model
from appliance.engine.runners.llamacpp import LlamaCppRunner
from appliance.engine.types import Embedded, Error
from appliance.errors import InvalidRequest, InvalidToken, ModelNotFound, from_wire
from appliance.library.catalog import ModelSpec, catalog
from tests.engine.gguf_fixtures import write_tiny

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "embeddings are vectors of floats, " * 6, "Ünïcödé and emoji 🙂"]
# one thread: llama.cpp's threads spin at every barrier and crawl when other processes hold the cores
CFG = EngineConfig(n_ctx=512, n_slots=1, n_threads=1, n_batch=512, speculate="off", prompt_cache=False)


def reference(path, texts, pooling: int) -> np.ndarray:
    """llama-cpp-python's high-level embeddings, L2-normalised (per-token ones averaged first, one
    text per call: 0.3.36 reads a batch's per-token rows from the wrong offsets past the first)."""
    llm = L.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                  pooling_type=pooling, verbose=False)
    try:
        if pooling == L.LLAMA_POOLING_TYPE_NONE:
            vecs = np.array([np.mean(llm.embed(t), axis=0) for t in texts])
            return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
        return np.array(llm.embed(texts, normalize=True))
    finally:
        llm.close()


def run(embedder: Embedder, events: list, *msgs: Embed) -> dict[str, object]:
    for msg in msgs:
        embedder.submit(msg)
    while embedder.has_work():
        embedder.step()
    return {ev.request_id: ev for ev in events}


def vectors(ev: Embedded) -> np.ndarray:
    return np.array([ev.floats(i) for i in range(len(ev.n_tokens))])


@pytest.fixture(scope="module", params=["mean", "last", "none"])
def embedding_model(request, tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("emb") / f"tiny-{request.param}.gguf", "llama", pooling=request.param)
    runner = EmbeddingRunner(CFG, path, "tiny-embed")
    yield path, runner, request.param
    runner.close()


def embedder_of(runner, ctx=None) -> tuple[Embedder, list]:
    events: list = []
    text = lambda t, special: runner.tokenize(t, add_special=special, parse_special=True)  # noqa: E731
    return Embedder(ctx or runner.embeddings, text, lambda ids, p: None, events.append), events


def test_vectors_match_llama_cpp_pythons_embed(embedding_model):
    path, runner, pooling = embedding_model
    embedder, events = embedder_of(runner)
    got = run(embedder, events, Embed("r", tuple(TEXTS)))["r"]
    assert isinstance(got, Embedded) and got.n_embd == 64
    assert got.n_tokens == tuple(len(runner.tokenize(t, True, True)) for t in TEXTS)
    ours = vectors(got)
    ref = reference(path, TEXTS, {"mean": 1, "last": 3, "none": 0}[pooling])
    assert np.abs(ours - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert runner.info.settings["embeddings"]["pooling"] == pooling


def test_a_batch_gives_what_one_input_at_a_time_gives_in_one_forward(embedding_model):
    _, runner, _ = embedding_model
    calls: list[int] = []

    class Counting:   # the real context, with its forwards counted
        def __getattr__(self, name):
            return getattr(runner.embeddings, name)

        def embed(self, seqs):
            calls.append(len(seqs))
            return runner.embeddings.embed(seqs)

    embedder, events = embedder_of(runner, Counting())
    batch = vectors(run(embedder, events, Embed("all", tuple(TEXTS)))["all"])
    assert calls == [len(TEXTS)]
    ones = run(embedder, events, *(Embed(f"one{i}", (t,)) for i, t in enumerate(TEXTS)))
    # five requests waiting together are packed into one forward too
    assert calls == [len(TEXTS), len(TEXTS)]
    each = []
    for i, t in enumerate(TEXTS):
        events.clear()
        each.append(vectors(run(embedder, events, Embed(f"alone{i}", (t,)))[f"alone{i}"])[0])
    assert np.abs(batch - np.array(each)).max() < 1e-6
    assert np.abs(batch - np.vstack([vectors(ones[f"one{i}"]) for i in range(len(TEXTS))])).max() < 1e-6


def test_token_ids_are_embedded_as_given(embedding_model):
    _, runner, _ = embedding_model
    embedder, events = embedder_of(runner)
    ids = tuple(runner.tokenize(TEXTS[1], True, True))
    # each in a forward of its own: two equal sequences side by side in one batch sit at other
    # KV cells, and their mean-pooled vectors can differ in the last bit (seen on a 2-core EPYC)
    text = run(embedder, events, Embed("t", (TEXTS[1],)))["t"]
    events.clear()
    given = run(embedder, events, Embed("i", (ids,)))["i"]
    assert given.n_tokens == text.n_tokens == (len(ids),)
    assert np.array_equal(vectors(text), vectors(given))


def test_a_vector_per_token_where_the_model_pools_none(embedding_model):
    path, runner, pooling = embedding_model
    embedder, events = embedder_of(runner)
    pooled = vectors(run(embedder, events, Embed("p", tuple(TEXTS[:2])))["p"])
    got = run(embedder, events, Embed("t", tuple(TEXTS[:2]), per_token=True))["t"]
    assert got.per_token == (pooling == "none")
    if pooling != "none":      # a model that pools answers its pooled vectors
        assert np.array_equal(vectors(got), pooled)
        return
    llm = L.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                  pooling_type=L.LLAMA_POOLING_TYPE_NONE, verbose=False)
    try:
        for i, text in enumerate(TEXTS[:2]):
            rows = np.array(got.rows(i))
            assert rows.shape == (got.n_tokens[i], 64)
            assert np.abs(rows - np.array(llm.embed(text))).max() < 1e-5     # not normalised
            assert np.abs(normalized(rows.mean(axis=0, keepdims=True), 2)[0] - pooled[i]).max() < 1e-5
    finally:
        llm.close()


def test_the_pooling_flag_overrides_the_gguf(tmp_path):
    path = write_tiny(tmp_path / "mean.gguf", "llama", pooling="mean")
    runner = EmbeddingRunner(dataclasses.replace(CFG, pooling="none"), path, "tiny-embed")
    try:
        assert runner.embeddings.per_token and runner.info.settings["embeddings"]["pooling"] == "none"
    finally:
        runner.close()
    with pytest.raises(ValueError, match="pooling must be none, mean, cls or last"):
        dataclasses.replace(CFG, pooling="max")


def test_a_text_counts_the_bos_its_tokenizer_adds_and_a_mix_has_it_only_before_a_first_text(tmp_path):
    path = write_tiny(tmp_path / "bos.gguf", "llama", pooling="mean", add_bos=True)
    llm = L.Llama(str(path), vocab_only=True, verbose=False)     # an independent tokenizer
    text, bos = llm.tokenize(b"hello world", add_bos=False), llm.token_bos()
    assert llm.tokenize(b"hello world") == [bos, *text]
    llm.close()
    runner = EmbeddingRunner(CFG, path, "bos")
    try:
        embedder, events = embedder_of(runner)
        got = run(embedder, events, Embed("b", ("hello world", tuple(text), ("hello world", 5), (5, "hello world"))))["b"]
        assert got.n_tokens == (len(text) + 1, len(text), len(text) + 2, len(text) + 1)
        ids = vectors(run(embedder, events, Embed("i", ((bos, *text, 5),)))["i"])
        assert np.abs(vectors(got)[2] - ids[0]).max() < 1e-6     # the mix is the BOS, the text's tokens, 5
    finally:
        runner.close()


def test_the_chat_model_embeds_beside_generation_without_changing_it(tmp_path):
    path = write_tiny(tmp_path / "chat.gguf", "llama")
    runner = LlamaCppRunner(EngineConfig(n_ctx=256, n_slots=2, n_threads=1, prompt_cache=False), path, "chat")
    try:
        prompt = tuple(runner.tokenize(TEXTS[3], add_special=True))
        before = runner.forward([Span(0, prompt, 0, 1)])[0]
        ctx = for_chat_model(runner)
        embedder, events = embedder_of(runner, ctx)
        got = vectors(run(embedder, events, Embed("e", tuple(TEXTS)))["e"])
        runner.truncate(0, 0)
        after = runner.forward([Span(0, prompt, 0, 1)])[0]
        assert np.array_equal(before, after)
        assert np.abs(got - reference(path, TEXTS, L.LLAMA_POOLING_TYPE_MEAN)).max() < 1e-5
        ctx.close()
    finally:
        runner.close()


# -- the Embedder over a fake context: packing, order, refusals ------------------------------------
class FakeContext:
    """Vector of a sequence: (first token, length, 0...): which input a vector is, at a glance;
    a token's (token, position, 0, 0) where it pools none."""

    n_embd, max_tokens, n_seq_max = 4, 10, 3

    def __init__(self, per_token: bool = False) -> None:
        self.forwards: list[list[tuple[int, ...]]] = []
        self.per_token = per_token

    def embed(self, seqs):
        self.forwards.append([tuple(s) for s in seqs])
        return np.array([[s[0], len(s), 0, 0] for s in seqs], np.float32)

    def embed_tokens(self, seqs):
        self.forwards.append([tuple(s) for s in seqs])
        return [np.array([[t, j, 0, 0] for j, t in enumerate(s)], np.float32) for s in seqs]

    def close(self):
        pass


def fake(bos: int | None = None, per_token: bool = False) -> tuple[Embedder, list, FakeContext]:
    """A text's tokens are its characters' codes, after `bos` where specials are added."""
    ctx, events = FakeContext(per_token), []

    def check(ids, param):
        if any(t >= 1000 for t in ids):
            raise InvalidToken("outside the vocabulary", param=param)

    def tokenize(text, special):
        return ([bos] if special and bos is not None else []) + [ord(c) for c in text]

    return Embedder(ctx, tokenize, check, events.append), events, ctx


def test_inputs_are_packed_in_arrival_order_within_the_batch_limits():
    embedder, events, ctx = fake()
    embedder.submit(Embed("a", ((1,) * 4, (2,) * 4, (3,) * 4), normalize=False))
    embedder.submit(Embed("b", ((4,), (5,), (6,), (7,)), normalize=False))
    embedder.step()        # 4 + 4 tokens; the third input (4 more) waits
    assert ctx.forwards[-1] == [(1,) * 4, (2,) * 4] and not events
    embedder.step()        # three sequences at most: a's last, b's first two
    assert ctx.forwards[-1] == [(3,) * 4, (4,), (5,)]
    assert [ev.request_id for ev in events] == ["a"]
    embedder.step()
    assert ctx.forwards[-1] == [(6,), (7,)] and [ev.request_id for ev in events] == ["a", "b"]
    assert not embedder.has_work()
    a, b = events
    assert vectors(a)[:, :2].tolist() == [[1, 4], [2, 4], [3, 4]] and a.n_tokens == (4, 4, 4)
    assert vectors(b)[:, 0].tolist() == [4, 5, 6, 7]


def test_vectors_are_l2_normalised_little_endian_float32():
    embedder, events, _ = fake()
    got = run(embedder, events, Embed("n", ((3, 9, 9, 9),)))["n"]
    assert got.floats(0) == pytest.approx([0.6, 0.8, 0, 0])
    assert np.frombuffer(got.raw(0), "<f4").tolist() == got.floats(0)


@pytest.mark.parametrize("p,want", [
    (2, [0.6, -0.8, 0, 0]), (1, [3 / 7, -4 / 7, 0, 0]), (0, [3 / 4 * 32760, -32760, 0, 0]),
    (3, [3 / 91 ** (1 / 3), -4 / 91 ** (1 / 3), 0, 0]),
])
def test_norms_are_llama_cpps_embd_normalize(p, want):
    assert normalized(np.array([[3.0, -4.0, 0, 0]]), p)[0] == pytest.approx(want)
    embedder, events, _ = fake()
    got = run(embedder, events, Embed("n", ((3, 9, 9, 9),), norm=p))["n"]
    assert got.floats(0) == pytest.approx(normalized(np.array([[3.0, 4.0, 0, 0]]), p)[0].tolist())
    events.clear()
    raw = run(embedder, events, Embed("r", ((3, 9, 9, 9),), normalize=False, norm=p))["r"]
    assert raw.floats(0) == [3, 4, 0, 0]


def test_mixed_inputs_have_the_bos_only_before_a_first_text():
    embedder, events, ctx = fake(bos=1)
    run(embedder, events, Embed("m", (("ab", 5, "c"), (5, "ab"), "ab", (7, 8)), normalize=False))
    assert ctx.forwards == [[(1, 97, 98, 5, 99), (5, 97, 98)], [(1, 97, 98), (7, 8)]]
    events.clear()
    embedder.submit(Embed("bad", (("ab", 5), ("ab", 1000))))
    [err] = events
    e = from_wire(err.kind, err.message, err.fields)
    assert (e.code, e.param) == ("invalid_token", "input[1]")


def test_per_token_vectors_are_rows_never_normalised_and_never_share_a_forward_with_pooled():
    embedder, events, ctx = fake(per_token=True)
    got = run(embedder, events, Embed("a", ((3, 4), (5,)), per_token=True), Embed("b", ((6,),), normalize=False))
    assert ctx.forwards == [[(3, 4), (5,)], [(6,)]]
    a, b = got["a"], got["b"]
    assert a.per_token and a.n_tokens == (2, 1) and a.rows(0) == [[3, 0, 0, 0], [4, 1, 0, 0]]
    assert a.rows(1) == [[5, 0, 0, 0]]
    assert not b.per_token and b.rows(0) == [[6, 1, 0, 0]]
    embedder, events, ctx = fake()                                 # a model that pools: pooled
    assert not run(embedder, events, Embed("c", ((3, 4),), per_token=True))["c"].per_token


def test_an_input_over_the_limit_says_too_large_in_words_clients_match():
    embedder, events, _ = fake()
    embedder.submit(Embed("e", ("abc", "x" * 11)))
    [err] = events
    assert err.message == ("input[1] (11 tokens) is too large to process: this model's maximum context length for "
                           "an embedding input is 10 tokens; shorten it or send truncate: true to cut it")


def test_an_aborted_request_is_dropped_and_others_go_on():
    embedder, events, ctx = fake()
    embedder.submit(Embed("x", ((1,) * 8, (2,) * 8)))
    embedder.submit(Embed("y", ((3,),)))
    embedder.step()
    embedder.abort("x")
    while embedder.has_work():
        embedder.step()
    assert [ev.request_id for ev in events] == ["y"] and ctx.forwards[-1] == [(3,)]


@pytest.mark.parametrize("msg,param,code", [
    (Embed("e", ("abc", "x" * 11)), "input[1]", "context_length_exceeded"),
    (Embed("e", ("abc", (5, 1000))), "input[1]", "invalid_token"),
    (Embed("e", ((),)), "input[0]", "invalid_request"), (Embed("e", ()), "input", "invalid_request"),
    (Embed("e", ("abc",), dimensions=3), "dimensions", "invalid_request"),
])
def test_a_bad_input_is_one_error_naming_it(msg, param, code):
    embedder, events, ctx = fake()
    embedder.submit(msg)
    assert not embedder.has_work() and not ctx.forwards
    [err] = events
    assert isinstance(err, Error)
    e = from_wire(err.kind, err.message, err.fields)
    assert (e.status, e.code, e.param) == (400, code, param)


def test_truncate_cuts_a_long_input_to_the_limit_and_counts_what_was_embedded():
    embedder, events, ctx = fake()
    got = run(embedder, events, Embed("t", ("x" * 25, "yy"), truncate=True, dimensions=4))["t"]
    assert got.n_tokens == (10, 2) and ctx.forwards[0] == [(ord("x"),) * 10]


# -- which model answers: the catalog's embedding model and the pool's rule -------------------------
def test_embedding_model_is_served_last_and_never_the_default(tmp_path):
    chat, emb = write_tiny(tmp_path / "chat.gguf", "llama"), write_tiny(tmp_path / "e.gguf", "llama", pooling="mean")
    specs, default = catalog(config.load({"model": str(chat), "embedding_model": str(emb)}, env={}))
    assert [(s.name, s.kind) for s in specs] == [("chat", "chat"), ("e", "embedding")] and default == "chat"
    cfg = specs[1].engine_config(config.load({"n_batch": "256", "prefill_chunk": "256"}, env={}), default=False)
    assert (cfg.n_slots, cfg.n_ctx) == (1, 256)          # the fit planner sizes one batch, not a chat pool
    for path, match in ((tmp_path / "none.gguf", "no such model file"), (chat, "already named chat")):
        with pytest.raises(ValueError, match=f"--embedding-model {path}: .*{match}"):
            catalog(config.load({"model": str(chat), "embedding_model": str(path)}, env={}))


@contextlib.contextmanager
def pool_of(*specs: tuple[str, str], **flags: str):
    pool = ModelPool([ModelSpec(n, Path(f"/m/{n}.gguf"), "file", kind=k) for n, k in specs], specs[0][0],
                     config.load(flags, env={}))
    try:
        yield pool
    finally:
        pool.close()


def test_the_embedding_model_answers_its_name_no_name_and_unknown_names():
    with pool_of(("chat", "chat"), ("e5", "embedding")) as pool:
        assert [pool.resolve_embedding(m) for m in ("e5", "e5.gguf", None, "text-embedding-3-small")] == ["e5"] * 4
        with pytest.raises(InvalidRequest, match="chat is a chat model .* --embedding-model chat"):
            pool.resolve_embedding("chat")
        assert pool.resolve("gpt-4o") == "chat"            # still one chat model: any name is it


def test_embedding_model_chat_makes_every_chat_model_answer():
    with pool_of(("qwen", "chat"), ("llama", "chat"), embedding_model="chat") as pool:
        assert [pool.resolve_embedding(m) for m in ("llama", None)] == ["llama", "qwen"]
        with pytest.raises(ModelNotFound):
            pool.resolve_embedding("text-embedding-3-small")


def test_embedding_model_chat_with_one_model_takes_any_name():
    with pool_of(("qwen", "chat"), embedding_model="chat") as pool:
        assert [pool.resolve_embedding(m) for m in ("text-embedding-3-small", "text-embedding-ada-002", None)] == \
            ["qwen"] * 3


def test_without_an_embedding_model_the_refusal_names_the_flag():
    with pool_of(("qwen", "chat")) as pool:
        for name in (None, "qwen", "text-embedding-3-small"):
            with pytest.raises(InvalidRequest, match="--embedding-model"):
                pool.resolve_embedding(name)
