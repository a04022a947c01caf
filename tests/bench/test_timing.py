"""Timing arithmetic on synthetic event streams (shared/BENCHMARKING.md, rules 3 and 6)."""
from __future__ import annotations

import pytest

from appliance.bench.session import nonce
from appliance.bench.timing import NoContent, StreamTrace, aggregate_rate, measure


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def trace(chunks, usage=None, timings=None, t_send=10.0) -> StreamTrace:
    return StreamTrace(t_send=t_send, chunks=list(chunks), usage=usage, timings=timings)


def test_decode_excludes_ttft():
    # sent at 10.0, first token at 10.5, then one token every 0.1 s: 11 tokens, 10 after the first
    t = trace([(10.5 + 0.1 * i, " w") for i in range(11)],
              usage={"prompt_tokens": 200, "completion_tokens": 11})
    m = measure(t, words)
    assert m.ttft_ms == pytest.approx(500.0)
    assert m.client_decode_tps == pytest.approx(10 / 1.0)      # not 11 / 1.5
    assert m.prefill_tps == pytest.approx(200 / 0.5)
    assert m.generated_tokens == 11


def test_tokens_are_counted_from_content_not_chunks():
    # 3 chunks carrying 2 + 3 + 5 tokens: a held UTF-8 sequence or stop candidate released at once
    t = trace([(11.0, " a b"), (12.0, " c d e"), (13.0, " f g h i j")])
    m = measure(t, words)
    assert m.generated_tokens == 10                              # no usage: counted from the content
    assert m.client_decode_tps == pytest.approx(8 / 2.0)        # the first chunk's 2 tokens are excluded
    # with usage, the total comes from the server, the first chunk's share from its text
    m2 = measure(trace(t.chunks, usage={"prompt_tokens": 5, "completion_tokens": 12}), words)
    assert m2.client_decode_tps == pytest.approx(10 / 2.0)


def test_cached_prompts_have_no_prefill_rate_and_engine_figures_pass_through():
    t = trace([(10.2, "x"), (10.4, "y")],
              usage={"prompt_tokens": 1000, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 512}},
              timings={"predicted_per_second": 88.5, "prompt_per_second": 900.0, "tokens_per_step": 1.0})
    m = measure(t, words)
    assert m.cached_tokens == 512 and m.prefill_tps is None
    assert m.engine_decode_tps == 88.5 and m.engine_prefill_tps == 900.0 and m.tokens_per_step == 1.0


def test_one_chunk_has_no_decode_rate_and_no_content_is_an_error():
    m = measure(trace([(10.3, "only")], usage={"prompt_tokens": 3, "completion_tokens": 1}), words)
    assert m.client_decode_tps is None and m.prefill_tps == pytest.approx(10.0)
    with pytest.raises(NoContent):
        measure(trace([]), words)


def test_aggregate_counts_only_the_window_where_every_stream_decodes():
    a = trace([((10 + i) / 10, " t") for i in range(30)])    # 1.0 .. 3.9
    b = trace([((20 + i) / 10, " t") for i in range(10)])    # 2.0 .. 2.9
    # window (2.0, 2.9]: a has tokens at 2.1..2.9 (9), b at 2.1..2.9 (9)
    assert aggregate_rate([a, b], words) == pytest.approx(18 / 0.9)
    assert aggregate_rate([a, trace([(5.0, "t")])], words) is None   # never decoding together
    assert aggregate_rate([a, trace([])], words) is None


def test_nonces_differ():
    seen = {nonce() for _ in range(1000)}
    assert len(seen) == 1000 and all(len(n) == 12 for n in seen)


def test_a_reply_that_ends_at_once_is_timed_by_its_end():
    t = StreamTrace(t_send=10.0, usage={"prompt_tokens": 50, "completion_tokens": 0}, t_end=10.25)
    m = measure(t, words)
    assert m.ttft_ms == pytest.approx(250.0) and m.generated_tokens == 0 and m.client_decode_tps is None


def test_a_missing_usage_takes_the_given_prompt_size():
    m = measure(trace([(10.5, " a"), (10.6, " b")]), words, prompt_tokens=300)
    assert m.prompt_tokens == 300 and m.prefill_tps == pytest.approx(600.0)
