"""The decode step's hot path (issue 47: served decode as fast as bench's raw loop): the logits
row copy, the token-piece cache and greedy sampling's short path give what the slow paths gave."""
from __future__ import annotations

import ctypes

import llama_cpp as L
import numpy as np
import pytest

from appliance.engine.output.sampling import Sampler
from appliance.engine.runners.llamacpp import LogitsRows
from appliance.engine.runners.vocab import Vocab, load_model
from appliance.engine.types import SamplingParams

from .gguf_fixtures import write_tiny


def test_a_row_copy_is_the_buffer_then_and_stays_so():
    buf = (ctypes.c_float * 8)(*range(8))
    rows = LogitsRows(4)
    first = rows.copy(ctypes.cast(ctypes.byref(buf, 4 * 4), ctypes.POINTER(ctypes.c_float)))   # row 1
    assert first.tolist() == [4.0, 5.0, 6.0, 7.0]
    buf[4] = 40.0   # llama.cpp writes the next step's logits where the last were
    again = rows.copy(ctypes.cast(ctypes.byref(buf, 4 * 4), ctypes.POINTER(ctypes.c_float)))
    assert first.tolist() == [4.0, 5.0, 6.0, 7.0] and again.tolist() == [40.0, 5.0, 6.0, 7.0]
    assert rows.copy(ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_views_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(LogitsRows, "MAX_VIEWS", 2)
    buf = (ctypes.c_float * 6)(*range(6))
    rows = LogitsRows(2)
    got = [rows.copy(ctypes.cast(ctypes.byref(buf, 8 * i), ctypes.POINTER(ctypes.c_float))).tolist() for i in range(3)]
    assert got == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and len(rows.views) <= 2


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("vocab") / "tiny.gguf", "llama", n_layer=1, n_embd=16,
                      n_head=2, n_head_kv=1, n_ff=16)
    model = load_model(path, vocab_only=True)
    yield Vocab(model)
    L.llama_model_free(model)


def _piece(v: Vocab, tok: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = L.llama_token_to_piece(v.vocab, tok, buf, 256, 0, True)
    return buf.raw[:n]


def test_cached_pieces_are_llama_cpps(vocab):
    ids = [1, 2, 300, 301, 1000, 300, vocab.n_vocab - 1]
    want = b"".join(_piece(vocab, t) for t in ids)
    assert vocab.detokenize(ids) == want                        # cold: asked of llama.cpp
    assert vocab.detokenize(ids) == want                        # warm: from the cache
    assert [vocab.detokenize([t]) for t in ids] == [_piece(vocab, t) for t in ids]
    assert vocab.detokenize([]) == b""


def test_plain_greedy_is_the_chain_and_still_obeys_a_grammar():
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(64).astype(np.float32) for _ in range(20)]
    rows.append(np.zeros(64, np.float32))      # all tied: the lowest id
    plain = Sampler(SamplingParams(temperature=0.0), seed=0)
    assert plain.plain
    assert [plain(r) for r in rows] == [int(np.argmax(r)) for r in rows]
    allowed = np.zeros(64, bool)
    allowed[[5, 9]] = True
    assert all(plain(r, allowed) in (5, 9) for r in rows)
    for p in (SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.0, logit_bias=((3, 1.0),)),
              SamplingParams(temperature=0.7)):
        assert not Sampler(p, seed=0).plain
