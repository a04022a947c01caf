"""llama.cpp's other samplers against llama.cpp's own: the same logits row (over the embedded
model's whole vocabulary) through llama.cpp's sampler (llama_sampler_apply on a
llama_token_data_array, llama-cpp-python's low-level API) and through
appliance/engine/output/samplers.py and dry.py must keep the same tokens with the same logits.
"""
from __future__ import annotations

import ctypes

import llama_cpp as L
import numpy as np
import pytest

from appliance.engine.output.dry import BreakerTables, Dry
from appliance.engine.output.samplers import (
    Mirostat, dynamic_temperature, top_n_sigma_filter, typical_filter, xtc_filter,
)
from appliance.engine.runners.vocab import Vocab, load_model
from appliance.models import embedded_model_path

BREAKERS = ("\n", ":", "\"", "*")


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    model = load_model(embedded_model_path(), vocab_only=True)
    yield Vocab(model)
    L.llama_model_free(model)


def rows(n_vocab: int, seed: int, count: int = 4, peak: float = 3.0) -> list[np.ndarray]:
    """Logit rows shaped like a model's: a few likely tokens over a long tail."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.normal(0.0, 1.0, n_vocab).astype(np.float32)
        top = rng.choice(n_vocab, 12, replace=False)
        x[top] += rng.uniform(peak, peak + 6.0, 12).astype(np.float32)
        out.append(x)
    return out


def llama_apply(smpl, x: np.ndarray) -> tuple[dict[int, float], int]:
    """llama.cpp's sampler on row `x`: each surviving token's logit, and the selected index."""
    data = (L.llama_token_data * len(x))()
    for i, v in enumerate(x.tolist()):
        data[i].id, data[i].logit, data[i].p = i, v, 0.0
    arr = L.llama_token_data_array(data, len(x), -1, False)
    L.llama_sampler_apply(smpl, ctypes.byref(arr))
    base = ctypes.cast(arr.data, ctypes.c_void_p).value
    view = ctypes.cast(base, ctypes.POINTER(L.llama_token_data))
    kept = {view[i].id: view[i].logit for i in range(arr.size) if np.isfinite(view[i].logit)}
    return kept, (view[arr.selected].id if arr.selected >= 0 else -1)


def ours(x: np.ndarray) -> dict[int, float]:
    live = np.flatnonzero(np.isfinite(x))
    return dict(zip(live.tolist(), x[live].tolist()))


@pytest.mark.parametrize("p", [0.3, 0.7, 0.95])
def test_typical_keeps_what_llama_cpp_keeps(vocab, p):
    smpl = L.llama_sampler_init_typical(p, 1)
    for x in rows(vocab.n_vocab, 1):
        assert ours(typical_filter(x, p)).keys() == llama_apply(smpl, x)[0].keys()
    L.llama_sampler_free(smpl)


@pytest.mark.parametrize("n", [0.5, 1.0, 3.0])
def test_top_n_sigma_keeps_what_llama_cpp_keeps(vocab, n):
    smpl = L.llama_sampler_init_top_n_sigma(n)
    for x in rows(vocab.n_vocab, 2):
        assert ours(top_n_sigma_filter(x, n)).keys() == llama_apply(smpl, x)[0].keys()
    L.llama_sampler_free(smpl)


@pytest.mark.parametrize("threshold", [0.02, 0.1, 0.3])
def test_xtc_that_acts_drops_what_llama_cpp_drops(vocab, threshold):
    smpl = L.llama_sampler_init_xtc(1.0, threshold, 1, 7)    # probability 1: it acts at every step
    for x in rows(vocab.n_vocab, 3, peak=4.0):
        got = xtc_filter(x, 1.0, threshold, np.random.default_rng(0))
        assert ours(got).keys() == llama_apply(smpl, x)[0].keys()
    L.llama_sampler_free(smpl)


@pytest.mark.parametrize("temp,spread,exponent", [(0.8, 0.5, 1.0), (1.0, 0.9, 2.0), (0.5, 0.4, 0.5)])
def test_dynamic_temperature_scales_as_llama_cpp(vocab, temp, spread, exponent):
    smpl = L.llama_sampler_init_temp_ext(temp, spread, exponent)
    for x in rows(vocab.n_vocab, 4):
        t = dynamic_temperature(x, temp, spread, exponent)
        theirs = llama_apply(smpl, x)[0]
        ids = np.fromiter(theirs.keys(), dtype=np.int64)
        np.testing.assert_allclose(np.fromiter(theirs.values(), dtype=np.float64), x[ids] / t, rtol=2e-5)
    L.llama_sampler_free(smpl)


@pytest.mark.parametrize("version,tau", [(1, 3.0), (1, 5.0), (2, 3.0), (2, 5.0)])
def test_mirostat_truncates_where_llama_cpp_does(vocab, version, tau):
    """A fresh Mirostat (mu = 2 tau) keeps the candidates llama.cpp's keeps; which of them it
    draws is each one's own generator."""
    for x in rows(vocab.n_vocab, 5, peak=1.5):
        smpl = L.llama_sampler_init_mirostat(vocab.n_vocab, 1, tau, 0.1, 100) if version == 1 else \
            L.llama_sampler_init_mirostat_v2(1, tau, 0.1)
        kept, _ = Mirostat(version, tau, 0.1, vocab.n_vocab).truncate(x)
        assert set(kept.tolist()) == set(llama_apply(smpl, x)[0])
        L.llama_sampler_free(smpl)


def llama_dry(vocab: Vocab, multiplier, base, allowed, last_n, breakers=BREAKERS):
    arr = (ctypes.c_char_p * len(breakers))(*[b.encode() for b in breakers])
    return L.llama_sampler_init_dry(vocab.vocab, multiplier, base, allowed, last_n, arr, len(breakers))


def histories(vocab: Vocab) -> list[list[int]]:
    """Contexts with repeats: text that repeats itself across breakers, and token strings over a
    small alphabet (repeats of every length, overlapping), with and without breaker tokens."""
    nl, colon = vocab.tokenize("\n", False, False), vocab.tokenize(":", False, False)
    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    rng = np.random.default_rng(9)
    return [vocab.tokenize(text, False, False),
            vocab.tokenize("Story: the cat sat. Story: the cat sat.\nStory: the cat", False, False),
            rng.choice([100, 200, 300, 400], 400).tolist(),
            rng.choice([100, 200, 300, nl[0], colon[0]], 400).tolist(),
            (rng.choice([5, 6, 7], 60).tolist() * 5)]


@pytest.mark.parametrize("multiplier,base,allowed,last_n", [(0.8, 1.75, 2, 64), (1.5, 1.2, 3, 200),
                                                            (0.8, 1.75, 2, 1000), (2.0, 3.0, 1, 500)])
def test_dry_penalizes_as_llama_cpp(vocab, multiplier, base, allowed, last_n):
    tables = BreakerTables(vocab.detokenize, lambda t: vocab.tokenize(t, False, False), vocab.n_vocab)
    row = rows(vocab.n_vocab, 6, count=1)[0]
    penalized = 0
    for history in histories(vocab):
        smpl = llama_dry(vocab, multiplier, base, allowed, last_n)
        for tok in history:
            L.llama_sampler_accept(smpl, tok)
        theirs = llama_apply(smpl, row)[0]
        got = Dry(multiplier, base, allowed, last_n, tables(BREAKERS), history, 1).apply(row)
        np.testing.assert_allclose(got, np.array([theirs[i] for i in range(len(row))], dtype=np.float32),
                                   rtol=1e-6)
        penalized += int(np.count_nonzero(got != row))
        L.llama_sampler_free(smpl)
    assert penalized >= 3     # the cases do penalize


def test_dry_multi_token_breaker_ends_a_repeat_as_llama_cpp(vocab):
    """A breaker of several tokens (a word): its head token plus the tail tokens limit how far
    back a repeat reaches."""
    breakers = ("Story:", "\n")
    tables = BreakerTables(vocab.detokenize, lambda t: vocab.tokenize(t, False, False), vocab.n_vocab)
    assert any(tails != ((),) for tails in tables(breakers).values())   # some heads have tails
    history = vocab.tokenize("Story: the cat sat on the mat Story: the cat sat on the", False, False)
    row = rows(vocab.n_vocab, 8, count=1)[0]
    smpl = llama_dry(vocab, 0.8, 1.75, 2, 500, breakers)
    for tok in history:
        L.llama_sampler_accept(smpl, tok)
    theirs = llama_apply(smpl, row)[0]
    got = Dry(0.8, 1.75, 2, 500, tables(breakers), history, 1).apply(row)
    np.testing.assert_allclose(got, np.array([theirs[i] for i in range(len(row))], dtype=np.float32), rtol=1e-6)
    L.llama_sampler_free(smpl)
