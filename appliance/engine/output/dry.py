"""DRY ("Don't Repeat Yourself"), llama.cpp's repetition penalty for sequences: a token that
would extend a repeat of what the context already holds (prompt and reply) by more than
`allowed_length` tokens loses multiplier * base ^ (repeat length - allowed_length) of its logit.
Sequence breakers (by default newline, colon, quote, asterisk) end a repeat: a match never
reaches back past the last one, and a token that is one alone is never penalized.

Follows llama.cpp's llama_sampler_dry (src/llama-sampling.cpp, from koboldcpp) and is checked
against it by tests/engine/test_samplers_llamacpp.py. llama.cpp finds the repeats with a
Z-algorithm over the window; here the positions where a repeat could end are found with numpy
and extended one token at a time, which gives the same lengths (the longest common suffix of
the window up to each position and the whole window, capped at the breaker's limit).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Breakers = dict[int, tuple[tuple[int, ...], ...]]   # head token -> tails ((): the head alone breaks)

MAX_CHAR_LEN = 40     # a breaker's bytes beyond this are cut (llama.cpp's limits)
MAX_SEQ_LEN = 20      # and its tail's tokens
FLOAT_MAX_LOG = 88.7228391


def breakers(strings: Sequence[str], pieces: Sequence[bytes], tokenize: Callable[[str], list[int]]) -> Breakers:
    """Each breaker string as the token sequences that can begin it: every token whose text holds
    the whole string (a head alone), and every token whose text ends with the string's start,
    with the tokens of the rest as its tail."""
    out: dict[int, list[tuple[int, ...]]] = {}

    def add(tok: int, tail: tuple[int, ...]) -> None:
        tails = out.setdefault(tok, [])
        if tail not in tails:
            tails.append(tail)

    for s in strings:
        b = s.encode()[:MAX_CHAR_LEN]
        if not b:
            continue
        for tok, word in enumerate(pieces):
            if b in word:
                add(tok, ())
                continue
            pos = word.find(b[:1])
            while pos != -1:
                n = min(len(b), len(word) - pos)
                if word[pos:pos + n] == b[:n]:
                    add(tok, tuple(tokenize(b[n:].decode("utf-8", errors="replace"))[:MAX_SEQ_LEN]))
                pos = word.find(b[:1], pos + 1)
    return {tok: tuple(tails) for tok, tails in out.items()}


class Dry:
    """One request's DRY state: the context it looks back over (prompt, then each sampled token)."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int,
                 table: Breakers, history: Sequence[int], capacity: int) -> None:
        self.multiplier, self.base, self.allowed, self.last_n = multiplier, base, allowed_length, last_n
        self.table = table
        self.heads = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
        self.single = np.fromiter((t for t, tails in table.items() if () in tails), dtype=np.int64)
        self.max_exp = int(FLOAT_MAX_LOG / np.log(base)) if base > 1.000001 else 0
        self.seen = np.zeros(len(history) + capacity + 1, dtype=np.int64)   # grows if it must
        self.n = len(history)
        self.seen[:self.n] = history

    def accept(self, tok: int) -> None:
        if self.n == len(self.seen):
            self.seen = np.concatenate([self.seen, np.zeros_like(self.seen)])
        self.seen[self.n] = tok
        self.n += 1

    def apply(self, x: np.ndarray) -> np.ndarray:
        """`x` with the penalties of this step (a new array when any applies)."""
        w = self.seen[:self.n] if self.last_n < 0 else self.seen[max(0, self.n - self.last_n):self.n]
        if len(w) <= self.allowed:
            return x
        limit = self._rep_limit(w)
        if limit < self.allowed:
            return x
        counts = self._repeats(w, limit)          # counts[j]: repeat ending at w[j], before w[j + 1]
        hit = np.flatnonzero(counts >= self.allowed)
        if not hit.size:
            return x
        longest = np.full(x.shape[-1], -1, dtype=np.int64)
        np.maximum.at(longest, w[hit + 1], counts[hit])
        longest[self.single[self.single < len(longest)]] = -1
        toks = np.flatnonzero(longest >= 0)
        exp = longest[toks] - self.allowed
        if self.max_exp > 0:
            exp = np.minimum(exp, self.max_exp)
        out = np.array(x, copy=True)
        # llama.cpp's parameters are float32: a large exponent shows the difference from float64's
        base, multiplier = float(np.float32(self.base)), float(np.float32(self.multiplier))
        out[toks] -= (multiplier * np.power(base, exp.astype(np.float64))).astype(np.float32)
        return out

    def _rep_limit(self, w: np.ndarray) -> int:
        """How far back a repeat may reach: to the latest breaker (its tail, when it has one,
        matched toward the end of the window); the whole window when there is none."""
        at = np.flatnonzero(np.isin(w, self.heads))[::-1] if self.heads.size else ()
        last = len(w) - 1
        for pos in at:
            i = last - int(pos)                      # the head's distance from the end
            longest = -1
            for tail in self.table[int(w[pos])]:
                if longest < len(tail) <= i and tuple(w[pos + 1:pos + 1 + len(tail)].tolist()) == tail:
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return len(w)

    @staticmethod
    def _repeats(w: np.ndarray, limit: int) -> np.ndarray:
        """For each position j before the last, the length of the longest common suffix of
        w[..j] and w (capped at `limit`)."""
        last = len(w) - 1
        counts = np.zeros(last, dtype=np.int64)
        cand = np.flatnonzero(w[:last] == w[last])
        length = 1
        while cand.size and length < limit:
            ok = cand >= length
            ok[ok] = w[cand[ok] - length] == w[last - length]
            counts[cand[~ok]] = length
            cand, length = cand[ok], length + 1
        counts[cand] = min(length, limit)
        return counts


class BreakerTables:
    """The breaker table of each list of breaker strings for one vocabulary, made on first use
    (a scan of the whole vocabulary) and kept: requests send the same few lists."""

    def __init__(self, detokenize: Callable[[Sequence[int]], bytes], tokenize: Callable[[str], list[int]],
                 n_vocab: int) -> None:
        self.detokenize, self.tokenize, self.n_vocab = detokenize, tokenize, n_vocab
        self.pieces: list[bytes] | None = None
        self.tables: dict[tuple[str, ...], Breakers] = {}

    def __call__(self, strings: tuple[str, ...]) -> Breakers:
        if strings not in self.tables:
            if self.pieces is None:
                self.pieces = [self.detokenize([t]) for t in range(self.n_vocab)]
            self.tables[strings] = breakers(strings, self.pieces, self.tokenize)
        return self.tables[strings]

    def dry(self, params, history: Sequence[int], capacity: int) -> Dry | None:
        """A request's DRY state, or None when its parameters turn DRY off (as llama.cpp's do)."""
        p = params
        if p.dry_multiplier == 0.0 or p.dry_base < 1.0 or p.dry_penalty_last_n == 0:
            return None
        return Dry(p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                   self(p.dry_sequence_breakers), history, capacity)
