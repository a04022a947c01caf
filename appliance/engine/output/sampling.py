"""Logits -> token. Each step is a small pure function on a float32 logits row.

Order (llama.cpp's default chain, `SamplingParams.samplers`): logit bias -> penalties -> DRY ->
top-n-sigma -> top_k -> typical -> top_p -> min_p -> XTC -> temperature (dynamic with
dynatemp_range) -> draw; with Mirostat, logit bias -> temperature -> Mirostat. The samplers
beyond OpenAI's are in samplers.py and dry.py. Greedy is argmax with the lowest id on ties
(np.argmax returns the first maximum) of what the chain kept before the temperature, so a
greedy run is a function of the logits alone. Stop strings are matched on the detokenized
text by `StopMatcher`, which holds back any tail that could still become a stop string so a
stop is never leaked into the output.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..types import SamplingParams
from .dry import Dry
from .samplers import Mirostat, dynamic_temperature, scale, top_n_sigma_filter, typical_filter, xtc_filter

NEG_INF = np.float32(-np.inf)


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


BAN = -100.0   # OpenAI's word: a bias of -100 bans the token (here exactly: its logit becomes -inf)


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """`logits` with each (token, bias) added (llama.cpp's logit-bias sampler); a bias of BAN or
    less bans the token. Returns a new array when there is any bias."""
    if not bias:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    add = np.fromiter((b for _, b in bias), dtype=np.float32, count=len(bias))
    np.add.at(out, ids, add)              # a token given twice gets both, as llama.cpp's chain does
    out[ids[add <= BAN]] = NEG_INF
    return out


def apply_penalties(logits: np.ndarray, recent: list[int], presence: float, frequency: float,
                    repetition: float) -> np.ndarray:
    """OpenAI presence/frequency and CTRL-style repetition penalties over `recent` tokens.

    Returns a new array; `logits` is left untouched (it may be a view of the engine's buffer).
    """
    if not recent or (presence == 0.0 and frequency == 0.0 and repetition == 1.0):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    counts = Counter(recent)
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
    vals = out[ids]
    if repetition != 1.0:
        vals = np.where(vals > 0, vals / repetition, vals * repetition)
    vals = vals - n * frequency - presence
    out[ids] = vals
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.exp(x - m).sum())


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, largest first (lowest id first among equals)."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    k = min(k, values.shape[-1])
    part = np.argpartition(-values, k - 1)[:k]
    return part[np.lexsort((part, -values[part]))]


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties at the boundary all kept); k <= 0 keeps everything."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, NEG_INF).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    m = np.max(logits)
    e = np.exp((logits - m).astype(np.float64))
    return e / e.sum()


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p.

    Exact, without sorting the whole vocabulary: grow a candidate set of the k largest until
    its mass reaches p (the nucleus is then inside it), then sort only those.
    """
    if p >= 1.0:
        return logits
    probs = softmax(logits)
    n = probs.shape[-1]
    k = min(64, n)
    while True:
        cand = np.argpartition(probs, n - k)[n - k:] if k < n else np.arange(n)
        if probs[cand].sum() >= p or k == n:
            break
        k = min(n, k * 4)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cum, p) + 1)]
    out = np.full_like(logits, NEG_INF, dtype=np.float32)
    out[keep] = logits[keep]
    return out


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p x the most likely token's."""
    if min_p <= 0.0:
        return logits
    threshold = np.max(logits) + np.log(min_p)
    return np.where(logits >= threshold, logits, NEG_INF).astype(np.float32)


def draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    # shift before dividing: a tiny temperature must not overflow float32 to inf - inf = NaN
    x = logits.astype(np.float64)
    z = (x - np.max(x)) / temperature
    probs = np.exp(z)
    probs /= probs.sum()
    return int(rng.choice(probs.shape[-1], p=probs))


# the filters that always keep the most likely token: a greedy step has no need of them
KEEP_MAX = frozenset({"top_n_sigma", "top_k", "top_p", "min_p"})


class Sampler:
    """Per-request sampling state: the seeded generator, the penalty window, DRY's context and
    Mirostat's mu. Every step runs the whole chain in `params.samplers`' order, so the state
    advances once per sampled token and a verify that samples a draft's rows in order draws
    exactly what serial steps would."""

    def __init__(self, params: SamplingParams, seed: int, dry: Dry | None = None, n_vocab: int = 0) -> None:
        self.params, self.dry = params, dry
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.recent: list[int] = []
        self.final: np.ndarray | None = None   # post_sampling_probs: the distribution the last token was drawn from
        self.mirostat = Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, n_vocab) \
            if params.mirostat else None
        # greedy with no bias and no penalty: the argmax alone (the chain below returns the same)
        self.plain = (params.greedy and not params.logit_bias and params.presence_penalty == 0.0
                      and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
                      and dry is None and params.typical_p >= 1.0 and params.xtc_probability <= 0.0
                      and not params.post_sampling_probs)

    def __call__(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """`allowed`: a bool mask over the vocabulary (structured output); others are never drawn."""
        tok = int(logits.argmax()) if self.plain and allowed is None else self._chain(logits, allowed)
        self.recent.append(tok)
        if self.dry is not None:
            self.dry.accept(tok)
        return tok

    def _chain(self, logits: np.ndarray, allowed: np.ndarray | None) -> int:
        p = self.params
        x = self._masked(apply_logit_bias(logits, p.logit_bias), allowed)
        if p.logit_bias and not np.isfinite(x).any():
            x = self._masked(logits, allowed)   # the bans left no token the grammar allows: they yield
        if self.mirostat is not None:           # llama.cpp's Mirostat chain: temperature, then Mirostat
            tok = self.mirostat.draw(scale(x, p.temperature), self.rng)
            if p.post_sampling_probs:
                kept, probs = self.mirostat.last
                self.final = np.zeros(len(x))
                self.final[kept] = probs
            return tok
        temperature = None                      # not applied yet
        for name in p.samplers:
            if name == "temperature":
                if temperature is not None:
                    continue
                temperature = 0.0 if p.greedy else \
                    dynamic_temperature(x, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
                if temperature <= 0.0:          # greedy: only the largest survives what follows
                    return self._greedy(x)
                if name != p.samplers[-1]:      # samplers after it see the scaled row
                    x, temperature = scale(x, temperature), 1.0
            elif not (p.greedy and name in KEEP_MAX):
                x = self._step(name, x)
        if p.greedy:
            return self._greedy(x)
        temperature = 1.0 if temperature is None else temperature
        if p.post_sampling_probs:
            self.final = softmax(np.where(np.isfinite(x), x / temperature, NEG_INF))
        return draw(x, temperature, self.rng)

    def _greedy(self, x: np.ndarray) -> int:
        tok = greedy(x)
        if self.params.post_sampling_probs:     # the chain kept one token, with probability 1
            self.final = np.zeros(len(x))
            self.final[tok] = 1.0
        return tok

    def _step(self, name: str, x: np.ndarray) -> np.ndarray:
        p = self.params
        if name == "penalties":
            # llama.cpp's convention: 0 turns penalties off, -1 looks at the whole output
            window = self.recent if p.penalty_last_n < 0 else self.recent[len(self.recent) - p.penalty_last_n:]
            return apply_penalties(x, window, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        if name == "dry":
            return x if self.dry is None else self.dry.apply(x)
        if name == "top_n_sigma":
            return top_n_sigma_filter(x, p.top_n_sigma)
        if name == "top_k":
            return top_k_filter(x, p.top_k)
        if name == "typ_p":
            return typical_filter(x, p.typical_p)
        if name == "top_p":
            return top_p_filter(x, p.top_p)
        if name == "min_p":
            return min_p_filter(x, p.min_p)
        if name == "xtc":
            return xtc_filter(x, p.xtc_probability, p.xtc_threshold, self.rng)
        raise ValueError(f"unknown sampler {name!r}")

    @staticmethod
    def _masked(x: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
        return x if allowed is None else np.where(allowed, x, NEG_INF)


@dataclass
class StopResult:
    text: str        # text safe to emit now
    stopped: bool    # a stop string was found; text ends just before it
    which: str = ""  # that stop string


class StopMatcher:
    """Finds stop strings in streamed text without leaking them or any prefix of them."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> StopResult:
        if not self.stops:
            return StopResult(text, False)
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, which = min(hits)
            self.pending = ""
            return StopResult(buf[:at], True, which)
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return StopResult(buf[: len(buf) - hold], False)

    def flush(self) -> str:
        """At the end of generation, what was held back was not a stop after all."""
        out, self.pending = self.pending, ""
        return out
