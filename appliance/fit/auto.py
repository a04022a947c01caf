"""`--n-ctx auto`: the longest context per slot that fits the host's memory with the chosen
slots, KV type and placement, by the planner (`plan`'s `fits`), before anything loads.

The KV pool grows linearly with the context (and llama.cpp's compute buffer too, by a slot's
attention scores without flash attention), so whether a context fits is monotone in it: a
binary search over multiples of STEP positions, up to a ceiling: the trained context, or what the
RoPE scaling reaches (`appliance/rope.py`), or, with scaling asked for and no factor, MAX_AUTO.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..rope import ModelRope
from .devices import Device
from .model import ModelFacts
from .planner import FitRequest, plan, projector_of

STEP = 256
MAX_AUTO = 1 << 20          # positions: auto's ceiling when YaRN or linear scaling has no factor yet


def ceiling(cfg: Any, rope: ModelRope) -> int:
    """The longest context `cfg`'s RoPE flags let `rope`'s model be served at."""
    factor = cfg.rope_scale or (1.0 / cfg.rope_freq_scale if cfg.rope_freq_scale else 0.0)
    kind = cfg.rope_scaling or rope.kind
    if kind not in ("linear", "yarn"):
        return rope.n_ctx_train
    factor = factor or rope.factor
    if not factor:
        return MAX_AUTO
    return max(rope.n_ctx_train, int((cfg.yarn_orig_ctx or rope.orig_ctx or rope.n_ctx_train) * factor))


def longest_context(m: ModelFacts, req: FitRequest, devices: list[Device], top: int) -> int:
    """The longest n_ctx, a multiple of STEP up to `top` (or `top` itself), at which the plan
    fits; 0 when not even STEP positions do."""
    def fits(n: int) -> bool:
        return plan(m, replace(req, n_ctx=n), devices).fits

    if fits(top):
        return top
    lo, hi = 0, top // STEP          # fits(lo * STEP) (0: nothing), not fits(hi * STEP)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * STEP) else (lo, mid)
    return lo * STEP


def auto_context(cfg: Any, m: ModelFacts, req: FitRequest, devices: list[Device]) -> tuple[int, str]:
    """(n_ctx, the line for the start-up log) for --n-ctx auto; ValueError when nothing fits."""
    top = ceiling(cfg, m.positions)
    n = longest_context(m, req, devices, top)
    if n == 0:
        raise ValueError(f"--n-ctx auto: not even {STEP} positions per slot fit with {req.n_slots} slots and "
                         f"KV {req.kv_type} ({', '.join(plan(m, replace(req, n_ctx=STEP), devices).notes) or 'no room'})")
    kv = plan(m, replace(req, n_ctx=n), devices).use
    why = "the ceiling" if n == top else "memory"
    per = "in the pool the slots share" if req.kv_unified else "per slot"
    return n, (f"--n-ctx auto: {n:,} positions {per} ({req.n_slots} slots, KV {req.kv_type}, "
               f"{sum(u.kv for u in kv.values()) / 2**30:.2f} GiB of KV), limited by {why} (ceiling {top:,}: "
               f"{'the trained context' if top == m.n_ctx_train else 'what the RoPE scaling reaches' if top < MAX_AUTO else 'auto at most'})")


def request_of(cfg: Any, m: ModelFacts) -> FitRequest:
    """The planner's request for an engine config (serve's flags): its slots, KV type, batch and
    GPU layers and tensor overrides (a tensor sent to CPU is the planner's CPU's; any other
    device the main GPU's, as the load's own placement checks); the torch runner's KV is float32
    with --torch-dtype float32."""
    ngl = {"auto": None, "all": m.n_layer + 1}.get(cfg.n_gpu_layers)
    n_cpu_moe = m.n_layer if cfg.cpu_moe else cfg.n_cpu_moe
    kv = "f32" if cfg.engine == "torch" and cfg.torch_dtype == "float32" else cfg.kv_type
    return FitRequest(n_ctx=STEP, n_slots=cfg.n_slots, kv_type=kv, n_ubatch=min(cfg.n_ubatch, cfg.n_batch),
                      flash_attn=cfg.flash_attn or cfg.kv_type != "f16",
                      n_gpu_layers=int(cfg.n_gpu_layers) if ngl is None and cfg.n_gpu_layers != "auto" else ngl,
                      n_cpu_moe=None if n_cpu_moe is None else min(n_cpu_moe, m.n_layer),
                      overrides=tuple((p, "CPU" if d.upper() == "CPU" else "GPU0")
                                      for p, d in cfg.tensor_overrides()), projector=projector_of(cfg),
                      kv_unified=bool(getattr(cfg, "kv_unified", False)))


@lru_cache(maxsize=32)
def for_file(cfg: Any, path: Path) -> tuple[int, str]:
    """auto_context for a GGUF on this host (its devices as `appliance fit` sees them), once per
    process for a config and file: the serve command's check and the catalog agree."""
    from .command import host_devices
    from .devices import main_gpu_only
    from .model import from_gguf

    m = from_gguf(path)
    return auto_context(cfg, m, request_of(cfg, m), main_gpu_only(host_devices(None)))
