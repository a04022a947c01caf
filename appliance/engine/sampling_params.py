"""A request's sampling parameters: OpenAI's knobs, llama.cpp's samplers and their chain's
order, as the engine's Sampler (output/sampling.py) reads them. Part of the server <-> engine
boundary (types.py's Request carries them).
"""
from __future__ import annotations

from dataclasses import dataclass

# llama.cpp's default sampler chain (common/common.h), each run where it stands; logit bias and the
# grammar's mask come before it, the draw after it
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI's knobs plus llama.cpp's. temperature <= 0 means greedy (argmax, lowest id on ties)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int | None = None
    max_tokens: int | None = None
    # max_tokens is a ceiling, not a reservation: a prompt with less room than it is served up to
    # the context's end (Anthropic's clients send their model's largest output: Claude Code 32000)
    max_tokens_ceiling: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False          # report each token's log-probability
    top_logprobs: int = 0           # and this many most likely alternatives
    post_sampling_probs: bool = False   # of the distribution drawn from (after the chain), not the model's
    # (token id, bias) added to that token's logit before anything else; -inf (or <= -100) bans it
    logit_bias: tuple[tuple[int, float], ...] = ()
    # llama.cpp's other samplers, with its names, defaults and meanings (output/samplers.py, dry.py)
    typical_p: float = 1.0              # locally typical sampling; 1 disables
    top_n_sigma: float = -1.0           # keep logits within n standard deviations of the top; <= 0 disables
    xtc_probability: float = 0.0        # exclude top choices: how often
    xtc_threshold: float = 0.1          # and above which probability
    dynatemp_range: float = 0.0         # entropy-scaled temperature in temperature +- range; 0 disables
    dynatemp_exponent: float = 1.0
    mirostat: int = 0                   # 1 or 2: Mirostat replaces the chain after the temperature
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0         # DRY's repetition penalty over prompt and reply; 0 disables
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1        # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    samplers: tuple[str, ...] = SAMPLER_ORDER   # the chain's order (llama.cpp's --samplers)

    @property
    def greedy(self) -> bool:
        """The most likely token (after bias and penalties) is always drawn."""
        return (self.temperature <= 0.0 and self.dynatemp_range <= 0.0) or self.top_k == 1
