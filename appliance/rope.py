"""RoPE scaling: the context a model is served at and how its positions are rotated to reach it.

llama-server's flags (`--rope-scaling none|linear|yarn`, `--rope-scale`, `--rope-freq-base`,
`--rope-freq-scale`, `--yarn-*`) resolved against what the model's GGUF says (`ModelRope`), as
llama.cpp resolves its `llama_context_params`, into one `RopeScaling` that both runners use:
llama.cpp is given the resolved values (`llama_context_params`), the torch runner
builds its rotation tables from `pair_scale` and `magnitude`, which transcribe ggml's
`rope_yarn` (llama-cpp-python 0.3.36's vendored llama.cpp, `ggml-cpu/ops.cpp`):

    theta_j     = p * base^(-2j/n_dims)                  (a pair's angle at position p)
    interp      = freq_scale * theta_j                   (linear: every pair squeezed)
    yarn        : theta = interp (1 - mix_j) + theta_j mix_j, mix_j = ramp(j) * ext_factor,
                  ramp 1 for the fast pairs (below corr_dims' low), 0 past high, linear between;
                  cos and sin scaled by the magnitude 1 + 0.1 ln(1 / freq_scale)

llama.cpp sets YaRN's attention factor itself whenever the extrapolation mix is on
(`llama_context`'s constructor: get_mscale(factor) / (1 + 0.1 ln factor)): a `--yarn-attn-factor`
then changes nothing, so it is refused unless `--yarn-ext-factor 0`.

`resolve` also checks the served context: past the trained context only with scaling, and within
what the scaling reaches (the original context times the factor). Pure: no llama.cpp, no torch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

KINDS = ("none", "linear", "yarn")
BETA_FAST, BETA_SLOW = 32.0, 1.0     # llama.cpp's hparams defaults
DEFAULT_N_CTX = 8192                 # --n-ctx's default
AUTO_N_CTX = -1                      # --n-ctx auto, until fit.auto resolves it for a model and a host


@dataclass(frozen=True)
class ModelRope:
    """What a GGUF's metadata says of its positions (`{arch}.context_length`, `.rope.*`)."""

    n_ctx_train: int
    freq_base: float = 10000.0
    kind: str = "none"                 # rope.scaling.type (llama.cpp reads none as it is; linear x1 = none)
    factor: float = 0.0                # rope.scaling.factor (0: none given)
    orig_ctx: int = 0                  # rope.scaling.original_context_length (0: n_ctx_train)
    attn_factor: float = 1.0           # rope.scaling.attn_factor: multiplies every rotation

    @classmethod
    def from_meta(cls, get: Callable[[str], Any], arch: str) -> ModelRope:
        """From a metadata lookup (`get(key)` -> the value, a string of it, or None)."""
        def val(key: str, kind: type, default):
            v = get(f"{arch}.{key}")
            return default if v is None or v == "" else kind(v)

        kind = val("rope.scaling.type", str, "none")
        return cls(n_ctx_train=val("context_length", int, 0), freq_base=val("rope.freq_base", float, 10000.0),
                   kind=kind, factor=val("rope.scaling.factor", float, 0.0),
                   orig_ctx=val("rope.scaling.original_context_length", int, 0),
                   attn_factor=val("rope.scaling.attn_factor", float, 1.0))

    @property
    def scaled(self) -> bool:
        return self.kind in ("linear", "yarn") and self.factor not in (0.0, 1.0)


@dataclass(frozen=True)
class RopeScaling:
    """How a served model rotates: what llama.cpp is given and the torch runner computes."""

    kind: str                    # none | linear | yarn
    freq_base: float
    freq_scale: float            # positions squeezed by this: 1 / the context factor
    orig_ctx: int                # the context the rotation was trained for (YaRN's n_ctx_orig)
    ext_factor: float            # YaRN's extrapolation mix (0 for none and linear)
    attn_factor: float           # --yarn-attn-factor as given, 1 when not (llama.cpp's rule above)
    beta_fast: float
    beta_slow: float
    model_attn_factor: float = 1.0   # the GGUF's rope.scaling.attn_factor
    source: str = "model"        # what chose the kind: "flags" or "model" (the GGUF)

    @property
    def factor(self) -> float:
        return 1.0 / self.freq_scale

    def reach(self) -> int:
        """The longest context this rotation serves: the original context times the factor."""
        return round(self.orig_ctx * self.factor)

    def corr_dims(self, n_dims: int) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the pairs between which YaRN's ramp falls from 1 to 0."""
        def dim(beta: float) -> float:
            return n_dims * math.log(self.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(self.freq_base))

        return max(0.0, math.floor(dim(self.beta_fast))), min(n_dims - 1.0, math.ceil(dim(self.beta_slow)))

    def pair_scale(self, n_dims: int) -> list[float]:
        """Each rotated pair's angle multiplier (theta_j -> theta_j x this): freq_scale for linear,
        YaRN's blend of it with 1 (extrapolation) by the ramp, 1 for none."""
        if self.ext_factor == 0.0:
            return [self.freq_scale] * (n_dims // 2)
        low, high = self.corr_dims(n_dims)
        out = []
        for j in range(n_dims // 2):
            ramp = 1.0 - min(1.0, max(0.0, (j - low) / max(0.001, high - low)))
            mix = ramp * self.ext_factor
            out.append(self.freq_scale * (1.0 - mix) + mix)
        return out

    def magnitude(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention temperature, as llama.cpp sets it)."""
        if self.ext_factor == 0.0:
            return self.attn_factor * self.model_attn_factor
        f = self.factor
        return (1.0 + 0.1 * math.log(f) if f > 1.0 else 1.0) * self.model_attn_factor

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "factor": self.factor, "magnitude": self.magnitude()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeScaling:
        """From `as_dict`'s output (/health's settings.rope): its derived keys ignored."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def identity(self) -> str:
        """For a KV fingerprint: a saved state holds rotated keys."""
        return (f"rope={self.kind}:{self.freq_base:g}:{self.freq_scale:.9g}:{self.orig_ctx}:{self.ext_factor:g}:"
                f"{self.magnitude():.9g}:{self.beta_fast:g}:{self.beta_slow:g}")

    def describe(self, n_ctx: int, n_ctx_train: int, per: str = "per slot") -> str:
        """One line for the start-up log, /health and `fit`: the context served and how (`per`:
        whose positions, "per slot" or a shared pool's)."""
        if self.kind == "none" or self.freq_scale == 1.0:
            return f"{n_ctx:,} positions {per} (trained {n_ctx_train:,}), RoPE unscaled"
        how = "YaRN" if self.kind == "yarn" else "linear RoPE scaling"
        return (f"{n_ctx:,} positions {per} (trained {n_ctx_train:,}), {how} x{self.factor:g} of "
                f"{self.orig_ctx:,} (reaches {self.reach():,}; from the {'flags' if self.source == 'flags' else 'GGUF'})")


def _pick(given, model_value, default):
    return given if given is not None else (model_value if model_value else default)


def resolve(cfg: Any, model: ModelRope, n_ctx: int) -> RopeScaling:
    """The RopeScaling that `cfg`'s flags (an EngineConfig's rope_* and yarn_* fields) give for
    `model` served at `n_ctx` positions per slot, checked; ValueError naming the flag otherwise."""
    kind = cfg.rope_scaling or (model.kind if model.kind in KINDS else None)
    if kind is None:
        raise ValueError(f"the model's RoPE scaling {model.kind!r} is not supported (give --rope-scaling "
                         f"{' | '.join(KINDS)})")
    orig = cfg.yarn_orig_ctx or model.orig_ctx or model.n_ctx_train or n_ctx
    if orig > n_ctx and cfg.yarn_orig_ctx:
        raise ValueError(f"--yarn-orig-ctx {orig} is larger than the served context ({n_ctx} positions per "
                         "slot, --n-ctx): give a smaller --yarn-orig-ctx or a larger --n-ctx")
    given_scale = 1.0 / cfg.rope_scale if cfg.rope_scale else cfg.rope_freq_scale
    model_scale = 1.0 / model.factor if model.factor else None
    if kind == "none":
        scale = 1.0
    else:   # with no factor anywhere, the one that reaches the served context
        scale = _pick(given_scale, model_scale, min(1.0, orig / n_ctx))
    ext = _pick(cfg.yarn_ext_factor, None, 1.0 if kind == "yarn" else 0.0)
    if cfg.yarn_attn_factor is not None and ext != 0.0:
        raise ValueError("--yarn-attn-factor changes nothing while YaRN's extrapolation mix is on: llama.cpp "
                         "then sets the attention factor from the scale (1 + 0.1 ln factor); give "
                         "--yarn-ext-factor 0 with it, or leave it out")
    r = RopeScaling(kind=kind, freq_base=_pick(cfg.rope_freq_base, model.freq_base, 10000.0), freq_scale=scale,
                    orig_ctx=orig, ext_factor=ext, attn_factor=_pick(cfg.yarn_attn_factor, None, 1.0),
                    beta_fast=_pick(cfg.yarn_beta_fast, None, BETA_FAST),
                    beta_slow=_pick(cfg.yarn_beta_slow, None, BETA_SLOW),
                    model_attn_factor=model.attn_factor or 1.0,
                    source="flags" if cfg.rope_scaling or given_scale else "model")
    check_context(r, n_ctx, model.n_ctx_train)
    return r


def check_context(r: RopeScaling, n_ctx: int, n_ctx_train: int) -> None:
    """A context past the trained one needs scaling, and scaling that reaches it."""
    if n_ctx_train and n_ctx > n_ctx_train and (r.kind == "none" or r.freq_scale == 1.0):
        factor = math.ceil(n_ctx / n_ctx_train)
        raise ValueError(f"--n-ctx {n_ctx} is past the model's trained context ({n_ctx_train} positions) and "
                         f"its RoPE is not scaled: give --rope-scaling yarn (--rope-scale {factor} reaches "
                         f"{factor * n_ctx_train}), or a --n-ctx of at most {n_ctx_train}")
    if r.kind != "none" and n_ctx > r.reach() and n_ctx > n_ctx_train:
        need = math.ceil(n_ctx / r.orig_ctx)
        raise ValueError(f"--n-ctx {n_ctx} is past what {r.kind} scaling x{r.factor:g} of {r.orig_ctx} "
                         f"positions reaches ({r.reach()}): give --rope-scale {need} or a smaller --n-ctx")


def check_flags(cfg: Any) -> None:
    """What the flags alone make wrong, before any model is read (EngineConfig.__post_init__)."""
    if cfg.rope_scaling is not None and cfg.rope_scaling not in KINDS:
        raise ValueError(f"--rope-scaling must be one of {', '.join(KINDS)}, not {cfg.rope_scaling!r}")
    for name in ("rope_scale", "rope_freq_scale", "rope_freq_base", "yarn_attn_factor", "yarn_beta_fast",
                 "yarn_beta_slow"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value}")
    if cfg.yarn_ext_factor is not None and not 0 <= cfg.yarn_ext_factor <= 1:
        raise ValueError(f"--yarn-ext-factor must be between 0 and 1, not {cfg.yarn_ext_factor}")
    if cfg.yarn_orig_ctx is not None and cfg.yarn_orig_ctx < 0:
        raise ValueError(f"--yarn-orig-ctx must not be negative, not {cfg.yarn_orig_ctx}")
    if cfg.rope_scale and cfg.rope_freq_scale and not math.isclose(1.0 / cfg.rope_scale, cfg.rope_freq_scale):
        raise ValueError(f"--rope-scale {cfg.rope_scale:g} and --rope-freq-scale {cfg.rope_freq_scale:g} disagree "
                  "(one is the other's inverse): give one of them")
    if cfg.n_ctx > 0 and cfg.yarn_orig_ctx and cfg.yarn_orig_ctx > cfg.n_ctx:
        raise ValueError(f"--yarn-orig-ctx {cfg.yarn_orig_ctx} is larger than the served context (--n-ctx "
                  f"{cfg.n_ctx}): give a smaller --yarn-orig-ctx or a larger --n-ctx")
    if cfg.rope_scaling == "none" and (cfg.rope_scale or cfg.rope_freq_scale):
        raise ValueError("--rope-scaling none scales nothing: --rope-scale and --rope-freq-scale need linear or yarn")


def positions(cfg: Any, n_ctx_train: int, reach: int = 0) -> int:
    """Positions per slot `cfg` asks for: --n-ctx, 0 for the trained context; the default
    (DEFAULT_N_CTX, not a choice the user made) is at most the trained context, or what the
    model's own scaling reaches, unless scaling is asked for."""
    if cfg.n_ctx == AUTO_N_CTX:
        raise ValueError("--n-ctx auto is resolved for a model before it is served (fit.auto)")
    n_ctx = cfg.n_ctx or n_ctx_train
    asked = cfg.rope_scaling not in (None, "none") or cfg.rope_scale or cfg.rope_freq_scale
    if cfg.n_ctx == DEFAULT_N_CTX and n_ctx_train and not asked:
        return min(n_ctx, max(n_ctx_train, reach))
    return n_ctx


def positions_of(cfg: Any, model: ModelRope) -> int:
    """The positions per slot `served` gives, unchecked (the planner's estimate before a load)."""
    reach = int((model.orig_ctx or model.n_ctx_train) * model.factor) if model.scaled else 0
    return positions(cfg, model.n_ctx_train, reach)


def served(cfg: Any, model: ModelRope) -> tuple[int, RopeScaling]:
    """(positions per slot, the rotation) that `cfg` serves `model` at, checked (ValueError)."""
    n_ctx = positions_of(cfg, model)
    return n_ctx, resolve(cfg, model, n_ctx)
