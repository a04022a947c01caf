"""The sampling chain's pure functions, the Sampler and the StopMatcher, on hand-made rows."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.engine.output.sampling import (
    Sampler, StopMatcher, apply_logit_bias, apply_penalties, draw, greedy, min_p_filter, softmax, top_k_filter,
    top_p_filter,
)
from appliance.engine.types import SamplingParams

NEG = -np.inf


def row(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


# -- greedy ------------------------------------------------------------------------------------

def test_greedy_picks_the_maximum():
    assert greedy(row(0.1, 2.0, -1.0, 1.5)) == 1


def test_greedy_picks_the_lowest_id_on_ties():
    assert greedy(row(0.0, 3.0, 1.0, 3.0, 3.0)) == 1


# -- penalties ---------------------------------------------------------------------------------

def test_penalties_noop_returns_values_unchanged():
    x = row(1.0, -2.0, 3.0, 0.5)
    np.testing.assert_array_equal(apply_penalties(x, [0, 2], 0.0, 0.0, 1.0), x)
    np.testing.assert_array_equal(apply_penalties(x, [], 1.0, 1.0, 2.0), x)


def test_presence_penalty_subtracts_once_per_seen_token():
    x = row(1.0, 2.0, 3.0, 4.0)
    out = apply_penalties(x, [1, 1, 1, 3], presence=0.5, frequency=0.0, repetition=1.0)
    np.testing.assert_allclose(out, row(1.0, 1.5, 3.0, 3.5))


def test_frequency_penalty_scales_with_count():
    x = row(1.0, 2.0, 3.0, 4.0)
    out = apply_penalties(x, [1, 1, 1, 3], presence=0.0, frequency=0.25, repetition=1.0)
    np.testing.assert_allclose(out, row(1.0, 2.0 - 0.75, 3.0, 4.0 - 0.25))


def test_presence_and_frequency_combine():
    x = row(0.0, 2.0, 0.0, 0.0)
    out = apply_penalties(x, [1, 1], presence=1.0, frequency=0.5, repetition=1.0)
    np.testing.assert_allclose(out, row(0.0, 0.0, 0.0, 0.0))


def test_repetition_divides_positive_and_multiplies_negative():
    x = row(4.0, -4.0, 2.0, -1.0, 0.0)
    out = apply_penalties(x, [0, 1, 4, 0], presence=0.0, frequency=0.0, repetition=2.0)
    # seen: 0 (positive -> /2), 1 (negative -> *2), 4 (zero stays 0); 2 and 3 untouched
    np.testing.assert_allclose(out, row(2.0, -8.0, 2.0, -1.0, 0.0))


def test_penalties_leave_the_input_untouched():
    x = row(4.0, -4.0, 2.0, -1.0)
    before = x.copy()
    out = apply_penalties(x, [0, 1, 1], presence=0.3, frequency=0.2, repetition=1.5)
    np.testing.assert_array_equal(x, before)
    assert out is not x
    assert out.dtype == np.float32
    assert not np.array_equal(out, before)


# -- top_k -------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, -1, 5, 9])
def test_top_k_nonpositive_or_large_keeps_all(k):
    x = row(0.5, 1.0, -2.0, 3.0, 0.0)
    np.testing.assert_array_equal(top_k_filter(x, k), x)


def test_top_k_keeps_the_k_largest():
    x = row(0.5, 1.0, -2.0, 3.0, 0.0, 2.0)
    out = top_k_filter(x, 2)
    assert kept(out) == {3, 5}
    assert out[3] == 3.0 and out[5] == 2.0


def test_top_k_keeps_ties_at_the_boundary():
    x = row(1.0, 5.0, 2.0, 2.0, 0.0, 2.0)
    assert kept(top_k_filter(x, 2)) == {1, 2, 3, 5}


# -- top_p -------------------------------------------------------------------------------------

def test_top_p_one_keeps_all():
    x = row(0.0, 1.0, 2.0, 3.0)
    np.testing.assert_array_equal(top_p_filter(x, 1.0), x)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 (up to float rounding)
    x = np.log(row(0.5, 0.25, 0.125, 0.125)).astype(np.float32)
    assert kept(top_p_filter(x, 0.4)) == {0}
    assert kept(top_p_filter(x, 0.6)) == {0, 1}
    three = kept(top_p_filter(x, 0.8))  # 0.75 < 0.8 <= 0.875: one of the tied 0.125s joins
    assert len(three) == 3 and {0, 1} < three
    assert len(kept(top_p_filter(x, 0.99))) == 4


def test_top_p_keeps_at_least_one_token():
    x = row(0.0, 5.0, 1.0, 2.0)
    assert kept(top_p_filter(x, 0.0)) == {1}
    assert kept(top_p_filter(x, 1e-9)) == {1}


def test_top_p_keeps_original_logit_values():
    x = row(0.0, 5.0, 1.0, 4.0)
    out = top_p_filter(x, 0.9)
    for i in kept(out):
        assert out[i] == x[i]


def brute_top_p(x: np.ndarray, p: float) -> set[int]:
    probs = softmax(x)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    m = int(np.argmax(cum >= p)) + 1 if cum[-1] >= p else len(order)
    return set(order[:m].tolist())


@pytest.mark.parametrize("p", [0.2, 0.9])
def test_top_p_grows_candidates_beyond_64_on_a_flat_row(p):
    # 1000 near-equal logits: the first 64 candidates hold ~6% of the mass, so the candidate
    # set must grow (to 256 for p=0.2, to the whole row for p=0.9)
    x = np.arange(1000, dtype=np.float32) * 1e-4
    got = kept(top_p_filter(x, p))
    assert 64 < len(got) < 1000
    assert got == brute_top_p(x, p)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_a_sorted_reference_on_a_large_row(p):
    rng = np.random.default_rng(1234)
    x = (rng.standard_normal(5000) * 2.0).astype(np.float32)
    got = kept(top_p_filter(x, p))
    assert got == brute_top_p(x, p)


# -- min_p -------------------------------------------------------------------------------------

def test_min_p_zero_keeps_all():
    x = row(0.0, 1.0, 2.0)
    np.testing.assert_array_equal(min_p_filter(x, 0.0), x)


def test_min_p_drops_tokens_below_fraction_of_the_best():
    # probabilities relative to the best: 1, 0.5, 0.2, 0.05
    x = np.log(row(0.4, 0.2, 0.08, 0.02)).astype(np.float32)
    assert kept(min_p_filter(x, 0.1)) == {0, 1, 2}
    assert kept(min_p_filter(x, 0.3)) == {0, 1}
    assert kept(min_p_filter(x, 1.0)) == {0}


# -- draw ----------------------------------------------------------------------------------------

def test_draw_is_reproducible_with_the_same_seed():
    x = row(0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    a = [draw(x, 1.0, np.random.Generator(np.random.PCG64(7))) for _ in range(3)]
    rng1 = np.random.Generator(np.random.PCG64(42))
    rng2 = np.random.Generator(np.random.PCG64(42))
    s1 = [draw(x, 1.0, rng1) for _ in range(50)]
    s2 = [draw(x, 1.0, rng2) for _ in range(50)]
    assert s1 == s2
    assert len(set(a)) == 1
    assert len(set(s1)) > 1  # it is actually random


def test_draw_never_returns_a_filtered_token():
    x = row(NEG, 1.0, NEG, 1.0, NEG, 0.5, NEG, NEG)
    rng = np.random.Generator(np.random.PCG64(0))
    seen = {draw(x, 1.5, rng) for _ in range(500)}
    assert seen <= {1, 3, 5}
    assert seen == {1, 3, 5}


def test_draw_low_temperature_concentrates_on_the_best():
    x = row(0.0, 1.0, 0.5, 0.9)
    rng = np.random.Generator(np.random.PCG64(3))
    assert {draw(x, 0.01, rng) for _ in range(100)} == {1}


# -- Sampler ---------------------------------------------------------------------------------------

def _rows(n: int, vocab: int = 8, seed: int = 99) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(vocab).astype(np.float32) for _ in range(n)]


def test_sampler_same_seed_same_sequence():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=6, min_p=0.01, presence_penalty=0.2)
    rows = _rows(40)
    a, b = Sampler(params, 5), Sampler(params, 5)
    sa = [a(r) for r in rows]
    sb = [b(r) for r in rows]
    assert sa == sb
    assert a.recent == sa


def test_sampler_different_seed_differs():
    params = SamplingParams(temperature=1.5)
    rows = _rows(40)
    a, b = Sampler(params, 1), Sampler(params, 2)
    assert [a(r) for r in rows] != [b(r) for r in rows]


def test_sampler_greedy_is_argmax():
    rows = _rows(20)
    s = Sampler(SamplingParams(temperature=0.0), seed=123)
    assert [s(r) for r in rows] == [int(np.argmax(r)) for r in rows]


def test_sampler_top_k_one_is_greedy():
    rows = _rows(20)
    s = Sampler(SamplingParams(temperature=1.0, top_k=1), seed=123)
    assert [s(r) for r in rows] == [int(np.argmax(r)) for r in rows]


def test_sampler_applies_penalties_before_greedy():
    x = row(3.0, 2.9, 0.0, 0.0)
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), seed=0)
    assert s(x) == 0
    assert s(x) == 1  # token 0 now penalised below token 1


def test_sampler_only_draws_allowed_tokens():
    x = row(5.0, 4.9, 4.8, -5.0, -6.0, -7.0)
    s = Sampler(SamplingParams(temperature=1.0, top_k=3), seed=11)
    assert {s(x) for _ in range(100)} <= {0, 1, 2}


# -- logit bias -----------------------------------------------------------------------------------

def test_logit_bias_adds_to_the_logit_and_minus_100_bans():
    x = row(1.0, 2.0, 3.0, 4.0)
    out = apply_logit_bias(x, ((0, 5.0), (3, -100.0), (1, -0.5), (1, -0.5)))
    assert out.tolist() == [6.0, 1.0, 3.0, NEG]        # a token named twice gets both, as llama.cpp's chain
    assert x.tolist() == [1.0, 2.0, 3.0, 4.0] and apply_logit_bias(x, ()) is x


def test_sampler_applies_logit_bias_before_everything_else():
    x = row(3.0, 2.9, 0.0, 0.0)
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)), seed=0)(x) == 1
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((3, 3.5),)), seed=0)(x) == 3
    s = Sampler(SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0))), seed=3)
    assert {s(x) for _ in range(100)} == {2, 3}          # a ban is exact, whatever the temperature
    # top_k counts after the bias: the banned token is not among the k
    s = Sampler(SamplingParams(temperature=1.0, top_k=1, logit_bias=((0, -100.0),)), seed=0)
    assert s(x) == 1


def test_bans_that_leave_no_allowed_token_yield_to_the_grammar():
    x = row(3.0, 2.9, 0.0, 0.0)
    allowed = np.array([False, True, False, False])
    for temperature in (0.0, 1.0):
        s = Sampler(SamplingParams(temperature=temperature, logit_bias=((1, -100.0),)), seed=0)
        assert s(x, allowed) == 1


# -- StopMatcher --------------------------------------------------------------------------------

def run(m: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for p in pieces:
        r = m.feed(p)
        out.append(r.text)
        if r.stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_matcher_without_stops_passes_through():
    m = StopMatcher(())
    for piece in ["Hel", "lo", " <", "end>"]:
        r = m.feed(piece)
        assert r.text == piece and not r.stopped
    assert m.flush() == ""


def test_stop_matcher_ignores_empty_stop_strings():
    m = StopMatcher(("",))
    assert m.feed("abc").text == "abc"


def test_stop_split_across_feeds_is_never_leaked():
    m = StopMatcher(("<END>",))
    emitted = []
    for piece in ["Hello <", "E", "N", "D>", "after"]:
        r = m.feed(piece)
        emitted.append(r.text)
        if r.stopped:
            break
    assert r.stopped
    assert emitted == ["Hello ", "", "", ""]


def test_stop_prefix_is_held_back_while_it_could_still_match():
    m = StopMatcher(("STOP",))
    r = m.feed("abcST")
    assert r.text == "abc" and not r.stopped
    r = m.feed("O")
    assert r.text == "" and not r.stopped


def test_held_prefix_released_when_later_text_breaks_it():
    m = StopMatcher(("STOP",))
    assert m.feed("abcST").text == "abc"
    r = m.feed("ART")
    assert r.text == "START" and not r.stopped
    assert m.flush() == ""


def test_held_prefix_released_by_flush():
    m = StopMatcher(("STOP",))
    assert m.feed("the ST").text == "the "
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_overlapping_prefix_still_finds_the_stop():
    assert run(StopMatcher(("aab",)), ["xa", "a", "ab", "zz"]) == ("xa", True)


def test_earliest_of_several_stops_wins():
    m = StopMatcher(("world", "lo w"))
    r = m.feed("hello world")
    assert r.stopped and r.text == "hel"


def test_earliest_stop_wins_across_feeds():
    assert run(StopMatcher(("</s>", "\n\n")), ["one\n", "\ntwo</s>"]) == ("one", True)


def test_stop_found_in_a_single_feed_truncates():
    assert run(StopMatcher(("###",)), ["answer: 42### more"]) == ("answer: 42", True)


def test_text_without_stop_comes_out_whole():
    pieces = ["a <", "b", "> c <E", "ND", " d"]
    assert run(StopMatcher(("<END>",)), pieces) == ("".join(pieces), False)


def test_tiny_temperature_behaves_like_greedy_instead_of_overflowing():
    import numpy as np

    from appliance.engine.output.sampling import draw

    logits = np.array([1.0, 3.0, 2.0, -np.inf], dtype=np.float32)
    rng = np.random.Generator(np.random.PCG64(0))
    assert {draw(logits, 1.1754943508222875e-38, rng) for _ in range(20)} == {1}
