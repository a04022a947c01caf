"""Two sets of logits for the same text compared, position by position: pure numpy, no runner.

The device check (device_check.py) runs a fixed text through the device and through llama.cpp's
CPU backend and asks here whether they computed the same model. Legend: T positions (the text's
tokens), V the vocabulary; row t holds the logits after token t, which predict token t + 1.

    argmax agreement   share of positions whose top token is the same on both sides
    max |difference|   the largest absolute difference of a raw logit, any position, any token
    KL                 KL(p_cpu || p_device) of the softmaxes, nats, per position (mean, max)
    perplexity         exp(mean negative log-likelihood of the text's next tokens), each side

A device computing garbage (the ROCm fault of issue 72: perplexity 1,334 against 6.81) fails
every one of them; rounding (another reduction order, fp16 accumulation) moves KL by 1e-4 or so
and no argmax that is not a near tie. `Tolerance` holds the limits; `departures` says which were
passed, in words that name the figures.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class LogitComparison:
    positions: int          # T, rows compared
    argmax_agree: float     # 0..1
    max_abs_diff: float     # of raw logits
    kl_mean: float          # nats, mean over positions
    kl_max: float           # nats, the worst position
    ppl_device: float       # over T - 1 next tokens
    ppl_cpu: float
    worst_position: int     # where KL is largest
    finite: bool = True     # False: the device gave NaN or infinity somewhere

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        return (f"argmax agreement {self.argmax_agree:.1%} over {self.positions} positions, max |logit "
                f"difference| {self.max_abs_diff:.3g}, KL mean {self.kl_mean:.3g} max {self.kl_max:.3g} nats "
                f"(position {self.worst_position}), perplexity {self.ppl_device:.4g} on the device against "
                f"{self.ppl_cpu:.4g} on the CPU")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (logits: [T, V])."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def perplexity(logp: np.ndarray, targets: Sequence[int]) -> float:
    """exp of the mean NLL of targets[1:] under rows [:-1] (logp: [T, V] log-probabilities)."""
    nxt = np.asarray(targets[1:len(logp)], dtype=np.int64)
    if len(nxt) == 0:
        return float("nan")
    nll = -logp[np.arange(len(nxt)), nxt]
    return float(np.exp(nll.mean()))


def compare(device: np.ndarray, cpu: np.ndarray, targets: Sequence[int]) -> LogitComparison:
    """The figures for device logits against CPU logits of the same text (both [T, V]; `targets`
    the text's T token ids)."""
    if device.shape != cpu.shape or device.ndim != 2 or len(device) == 0:
        raise ValueError(f"logits of shapes {device.shape} and {cpu.shape}: want the same [T, V], T > 0")
    finite = bool(np.isfinite(device).all())
    dev = np.nan_to_num(device.astype(np.float64), nan=0.0, posinf=1e30, neginf=-1e30)
    lp_dev, lp_cpu = log_softmax(dev), log_softmax(cpu)
    kl = (np.exp(lp_cpu) * (lp_cpu - lp_dev)).sum(axis=1)          # [T]
    kl = np.maximum(kl, 0.0)                                        # rounding below zero
    diff = np.abs(dev - cpu.astype(np.float64))
    return LogitComparison(
        positions=len(device),
        argmax_agree=float((device.argmax(axis=1) == cpu.argmax(axis=1)).mean()),
        max_abs_diff=float(diff.max()) if finite else float("inf"),
        kl_mean=float(kl.mean()), kl_max=float(kl.max()),
        ppl_device=perplexity(lp_dev, targets), ppl_cpu=perplexity(lp_cpu, targets),
        worst_position=int(kl.argmax()), finite=finite)


@dataclass(frozen=True)
class Tolerance:
    """How far a device may be from the CPU and still serve. Set from lavapipe against the CPU
    build (docs/gpu.md, "The device check": the embedded model, argmax 94.7%, KL mean 0.0054, max
    0.026, perplexity x1.001) with room for a real GPU's fp16 accumulation (about 10x on KL);
    one zeroed tensor on the device gave argmax 48.9%, KL mean 1.16, perplexity x3.35."""

    min_argmax_agree: float = 0.80
    max_kl_mean: float = 0.05
    max_kl: float = 0.5
    max_ppl_ratio: float = 1.10      # either way: max(a/b, b/a)

    def as_dict(self) -> dict:
        return asdict(self)


def departures(c: LogitComparison, tol: Tolerance) -> list[str]:
    """What passed its limit, each in words naming the figure and the limit; [] when within."""
    out = []
    if not c.finite:
        out.append("the device gave NaN or infinite logits")
    if c.argmax_agree < tol.min_argmax_agree:
        out.append(f"argmax agreement {c.argmax_agree:.1%} < {tol.min_argmax_agree:.0%}")
    if c.kl_mean > tol.max_kl_mean:
        out.append(f"mean KL {c.kl_mean:.3g} > {tol.max_kl_mean:g} nats")
    if c.kl_max > tol.max_kl:
        out.append(f"KL at position {c.worst_position} {c.kl_max:.3g} > {tol.max_kl:g} nats")
    ratio = max(c.ppl_device / c.ppl_cpu, c.ppl_cpu / c.ppl_device) if c.ppl_cpu > 0 and c.ppl_device > 0 \
        else float("inf")
    if not ratio <= tol.max_ppl_ratio:       # a NaN perplexity fails too
        out.append(f"perplexity {c.ppl_device:.4g} on the device against {c.ppl_cpu:.4g} on the CPU "
                   f"(x{ratio:.3g} > x{tol.max_ppl_ratio:g})")
    return out
