"""The sampling knobs of an OpenAI body (chat and completions alike): the declared scalars
(params.py), `stop`, `logit_bias` and `n`, checked once and turned into the engine's
`SamplingParams`. wire.py reads the rest of a body; llama-server's translation (llamaserver.py)
sets what its own forms say on the same fields.
"""
from __future__ import annotations

import math
from typing import Any

from appliance.engine.types import SAMPLER_ORDER, SamplingParams
from appliance.errors import InvalidRequest

from .params import CHAT, MAX_BREAKERS, MAX_LOGIT_BIAS, MAX_STOPS, SAMPLERS, Param

LogitBias = tuple[tuple[int, float], ...]


def stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    if len(v) > MAX_STOPS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOPS} strings", param="stop")
    return tuple(s for s in v if s)


def logit_bias(body: dict) -> LogitBias:
    """OpenAI's logit_bias: an object from token ids (as strings, JSON's keys) to a bias between
    -100 and 100, added to that token's logit before sampling; -100 bans the token. Whether the
    ids are in the vocabulary the engine checks (a 400 naming the first that is not)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequest("'logit_bias' must be an object from token ids to biases, e.g. {\"1734\": -100}",
                             param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens; got {len(v)}", param="logit_bias")
    out = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(f"'logit_bias' keys must be token ids (non-negative integers); got {key!r}",
                                 param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias[{key!r}] must be a number between -100 and 100; got {bias!r}",
                                 param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def sampling_params(body: dict, n_ctx: int, table: dict[str, Param] = CHAT) -> SamplingParams:
    """The sampling knobs of `body`, checked against the endpoint's declarations (CHAT or
    COMPLETION, which differ in max_tokens' default)."""
    def get(name: str) -> Any:
        return table[name].read(body, n_ctx)

    max_tokens = get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = get("max_tokens")
    # checked in this order, so that of two mistakes the same one is reported as always
    knobs = {k: get(k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                 "frequency_penalty", "repeat_penalty", "repetition_penalty", "seed")}
    repeat = knobs.pop("repeat_penalty")  # llama.cpp's name for it
    if knobs["repetition_penalty"] is None:
        knobs["repetition_penalty"] = repeat
    knobs["penalty_last_n"] = get("repeat_last_n")
    knobs |= {p.name: get(p.name) for p in SAMPLERS}
    return SamplingParams(**knobs, max_tokens=max_tokens, stop=stops(body), ignore_eos=get("ignore_eos"),
                          logit_bias=logit_bias(body), dry_sequence_breakers=breakers(body), samplers=order(body))


# llama.cpp's sampler names (common_sampler_types_from_names, with its other spellings) and letters
SAMPLER_NAMES = {"penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top_k": "top_k",
                 "typ_p": "typ_p", "typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "top_p": "top_p",
                 "nucleus": "top_p", "min_p": "min_p", "xtc": "xtc", "temperature": "temperature",
                 "temp": "temperature"}
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature"}


def order(body: dict) -> tuple[str, ...]:
    """llama-server's `samplers`: the chain's order, as a list of names or a string of letters
    ("edskypmxt"); a sampler left out does not run (the temperature too: then the draw is at 1)."""
    v = body.get("samplers")
    if v is None:
        return SAMPLER_ORDER
    if isinstance(v, str):   # names when it has one of ";_-" (as llama.cpp reads it), else letters
        named = any(c in v for c in ";_-")
        names, table = (v.split(";"), SAMPLER_NAMES) if named else (list(v), SAMPLER_LETTERS)
    elif isinstance(v, list) and all(isinstance(n, str) for n in v):
        names, table = v, SAMPLER_NAMES
    else:
        raise InvalidRequest("'samplers' must be a list of sampler names or a string of their letters",
                             param="samplers")
    out = []
    for name in names:
        key = name.strip().lower().replace("-", "_")
        if key not in table:
            raise InvalidRequest(f"'samplers': unknown sampler {name!r}; this server has "
                                 f"{', '.join(sorted(set(SAMPLER_NAMES)))} (letters {''.join(SAMPLER_LETTERS)})",
                                 param="samplers")
        out.append(table[key])
    return tuple(out)


def breakers(body: dict) -> tuple[str, ...]:
    """DRY's sequence breakers: a list of strings (llama-server's default when absent)."""
    v = body.get("dry_sequence_breakers")
    if v is None:
        return SamplingParams.dry_sequence_breakers
    if not isinstance(v, list) or not all(isinstance(b, str) and b for b in v):
        raise InvalidRequest("'dry_sequence_breakers' must be a list of non-empty strings",
                             param="dry_sequence_breakers")
    if len(v) > MAX_BREAKERS:
        raise InvalidRequest(f"'dry_sequence_breakers' takes at most {MAX_BREAKERS} strings",
                             param="dry_sequence_breakers")
    return tuple(v)
