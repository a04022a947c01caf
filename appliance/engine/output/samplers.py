"""llama.cpp's other samplers, each a small function on a float32 logits row over the whole
vocabulary, in which a token the chain has dropped has the logit -inf (llama.cpp shrinks a
candidate array instead; the survivors and their order are the same).

Each follows llama.cpp's definition in src/llama-sampling.cpp (typical, top-n-sigma, XTC,
temp-ext, Mirostat 1 and 2), checked against its own samplers on the same rows by
tests/engine/test_samplers_llamacpp.py. Probabilities are computed in float64; llama.cpp's
float32 can place a boundary one token apart where two candidates' values differ in the last bit.
"""
from __future__ import annotations

import math

import numpy as np

NEG_INF = np.float32(-np.inf)
MIROSTAT_M = 100       # the tokens Mirostat 1 estimates the distribution's shape from (llama.cpp's m)


def _probs(x: np.ndarray) -> np.ndarray:
    """Softmax over the surviving tokens (0 for the dropped ones)."""
    z = x.astype(np.float64)
    e = np.exp(z - np.max(z))
    return e / e.sum()


def _probs32(x: np.ndarray) -> np.ndarray:
    """Softmax in float32 summed in order, as llama.cpp's softmax over a sorted candidate array
    (where a boundary is a cumulative sum over thousands of tokens, its rounding decides)."""
    e = np.exp(x - x[0], dtype=np.float32)
    return e / np.cumsum(e, dtype=np.float32)[-1]


def typical_filter(x: np.ndarray, p: float, min_keep: int = 1) -> np.ndarray:
    """Locally typical sampling: keep the tokens whose surprise is closest to the distribution's
    entropy until their probability passes p."""
    if p >= 1.0:
        return x
    live = np.flatnonzero(np.isfinite(x))
    live = live[np.argsort(-x[live], kind="stable")]   # most likely first (lowest id among equals)
    probs = _probs32(x[live])
    with np.errstate(divide="ignore"):
        surprise = -np.log(probs)
    entropy = np.cumsum(np.where(probs > 0, probs * surprise, np.float32(0)), dtype=np.float32)[-1]
    order = np.argsort(np.abs(surprise - entropy), kind="stable")
    cum = np.cumsum(probs[order], dtype=np.float32)
    over = np.flatnonzero((cum > p) & (np.arange(len(order)) >= min_keep - 1))
    keep = live[order[: over[0] + 1]] if over.size else live
    out = np.full_like(x, NEG_INF)
    out[keep] = x[keep]
    return out


def top_n_sigma_filter(x: np.ndarray, n: float) -> np.ndarray:
    """Keep the logits within n standard deviations (of the surviving logits) of the largest."""
    if n <= 0.0:
        return x
    live = x[np.isfinite(x)]
    if live.size <= 1:
        return x
    top, std = float(np.max(live)), float(np.std(live.astype(np.float64)))
    return np.where(x >= top - n * std, x, NEG_INF).astype(np.float32)


def xtc_filter(x: np.ndarray, probability: float, threshold: float, rng: np.random.Generator,
               min_keep: int = 1) -> np.ndarray:
    """Exclude Top Choices: with chance `probability`, drop every token at least `threshold`
    likely but the least likely of them. The chance is drawn at every step it could act, so a
    seeded run draws the same numbers whatever happens to the row."""
    if probability <= 0.0 or threshold > 0.5 or np.count_nonzero(np.isfinite(x)) < 2:
        return x
    if rng.random() > probability:
        return x
    probs = _probs(x)
    above = np.flatnonzero(probs >= threshold)
    n_live = np.count_nonzero(np.isfinite(x))
    if above.size < 2 or n_live - (above.size - 1) < min_keep:
        return x
    # all of them but the least likely (on equal probability: the one llama.cpp's sort puts last)
    order = above[np.lexsort((above, -probs[above]))]
    out = np.array(x, copy=True)
    out[order[:-1]] = NEG_INF
    return out


def dynamic_temperature(x: np.ndarray, temperature: float, spread: float, exponent: float) -> float:
    """llama.cpp's temp-ext: the temperature for this row, between temperature - spread and
    temperature + spread by the normalized entropy of the surviving tokens raised to `exponent`."""
    if spread <= 0.0:
        return temperature
    live = x[np.isfinite(x)]
    if live.size <= 1:
        return temperature
    probs = _probs(live)
    nz = probs[probs > 0]
    entropy = float(-np.sum(nz * np.log(nz)))
    lo, hi = max(0.0, temperature - spread), temperature + spread
    return lo + (hi - lo) * math.pow(entropy / math.log(live.size), exponent)


def scale(x: np.ndarray, temperature: float) -> np.ndarray:
    """The row at `temperature`; at 0 or below, only the largest logit survives (lowest id)."""
    if temperature <= 0.0:
        out = np.full_like(x, NEG_INF)
        i = int(np.argmax(x))
        out[i] = x[i]
        return out
    z = x.astype(np.float64)
    return ((z - np.max(z)) / temperature).astype(np.float32)


def _largest_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values, largest first (without sorting the rest)."""
    k = min(k, len(values))
    part = np.argpartition(-values, k - 1)[:k] if k < len(values) else np.arange(len(values))
    return part[np.lexsort((part, -values[part]))]


def _largest(values: np.ndarray, k: int) -> np.ndarray:
    return values[_largest_ids(values, k)]


class Mirostat:
    """Mirostat 1 (`version` 1) or 2: the truncation is steered so that the reply's surprise
    per token tracks tau; mu, the surprise ceiling, starts at 2 tau and moves by eta times each
    token's error. Its state is mu alone, advanced once per sampled token, in order: a verify
    that samples the draft's rows one by one advances it exactly as serial steps do."""

    def __init__(self, version: int, tau: float, eta: float, n_vocab: int) -> None:
        self.version, self.tau, self.eta, self.n_vocab = version, tau, eta, n_vocab
        self.mu = 2.0 * tau
        self.last: tuple[np.ndarray, np.ndarray] = (np.empty(0, dtype=np.int64), np.empty(0))   # drawn from

    def truncate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidates this step draws from (most likely first, lowest id among equals), with
        their probabilities renormalized. Only the candidates are sorted, not the vocabulary."""
        live = np.flatnonzero(np.isfinite(x))
        probs = _probs(x[live])
        if self.version == 1:
            k = self._k(_largest(probs, MIROSTAT_M))
            kept = live[_largest_ids(probs, k)]
        else:   # Mirostat 2 keeps the tokens whose surprise is at most mu (at least the top one)
            with np.errstate(divide="ignore"):
                keep = -np.log2(probs) <= self.mu
            kept = live[keep] if keep.any() else live[[int(np.argmax(probs))]]
        kept = kept[np.lexsort((kept, -x[kept]))]
        return kept, _probs(x[kept])

    def _k(self, top: np.ndarray) -> int:
        """Mirostat 1's k from the sorted largest probabilities `top`: the estimated Zipf exponent
        s_hat and the surprise ceiling mu."""
        m = len(top) - 1
        if m <= 0:
            return 1
        i = np.arange(m, dtype=np.float64)
        t = np.log((i + 2) / (i + 1))
        b = np.log(top[:m] / top[1:m + 1])
        s_hat = float(np.sum(t * b) / np.sum(t * t))
        eps = s_hat - 1
        k = math.pow((eps * math.pow(2, self.mu)) / (1 - math.pow(self.n_vocab, -eps)), 1 / s_hat)
        return max(1, int(k) if math.isfinite(k) else self.n_vocab)

    def draw(self, x: np.ndarray, rng: np.random.Generator) -> int:
        kept, probs = self.last = self.truncate(x)
        i = int(rng.choice(len(kept), p=probs))
        self.mu -= self.eta * (-math.log2(probs[i]) - self.tau)
        return int(kept[i])
