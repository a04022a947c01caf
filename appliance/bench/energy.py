"""Each cell's energy from the host sampler's spans, and the run's idle power before any work.

The sampler (hostcheck/sampler.py) integrates every power reader over each span exactly
(hostcheck/energy.py). A served cell has two spans, prefill (send to first token) and decode
(first token to the stream's end); a raw or concurrent batch has one, which its cells share
equally. Where the host gives no energy, or a reader missed a span, the joules stay None and
`energy_note` carries the reason: never 0, never a guess.
"""
from __future__ import annotations

import time
from typing import Any

IDLE_PHASE = "idle"


def served_energy(sampler: Any, prefill: Any, decode: Any) -> dict[str, Any]:
    """ResultCell fields for a served cell from its prefill span and decode span (None when the
    stream never produced a first token: then the prefill span ran to the end)."""
    if sampler is None or prefill is None:
        return {"energy_note": "no host sampler"}
    spans = {"prefill": sampler.span_energy(prefill)}
    if decode is not None:
        spans["decode"] = sampler.span_energy(decode)
    out: dict[str, Any] = {}
    missing: dict[str, str] = {}
    for name, e in spans.items():
        out[f"{name}_s"] = e.seconds
        if isinstance(e.joules, float | int):
            out[f"{name}_j"] = float(e.joules)
        else:
            missing[name] = e.joules.reason
    out["request_s"] = sum(e.seconds for e in spans.values())
    if not missing:
        out["request_j"] = sum(out[f"{n}_j"] for n in spans)
    reasons = set(missing.values())
    out["energy_note"] = (reasons.pop() if len(reasons) == 1 and len(missing) == len(spans)
                          else "; ".join(f"{n}: {why}" for n, why in missing.items()))
    return out


def shared_energy(sampler: Any, span: Any, n_cells: int) -> dict[str, Any]:
    """ResultCell fields for one of `n_cells` cells measured together in one span: its share."""
    if sampler is None or span is None:
        return {"energy_note": "no host sampler"}
    e = sampler.span_energy(span)
    if not isinstance(e.joules, float | int):
        return {"request_s": e.seconds, "energy_note": e.joules.reason}
    return {"request_j": float(e.joules) / n_cells, "request_s": e.seconds,
            "energy_note": f"one {n_cells}-way batch's joules shared equally" if n_cells > 1 else ""}


def measure_idle(sampler: Any, seconds: float, sleep: Any = time.sleep) -> None:
    """Before the first cell: `seconds` of nothing, filed under the idle phase, so a report can
    give energy above idle beside the gross figure."""
    if sampler is None or seconds <= 0:
        return
    with sampler.phase(IDLE_PHASE):
        sleep(seconds)


def idle_watts(phases: dict[str, Any]) -> float | None:
    """The stored idle phase's mean power (watts), or None."""
    idle = phases.get(IDLE_PHASE) or {}
    j, s = idle.get("joules"), idle.get("seconds")
    return j / s if isinstance(j, (int, float)) and s else None


def above_idle(joules: float | None, seconds: float | None, idle_w: float | None) -> float | None:
    if joules is None or seconds is None or idle_w is None:
        return None
    return joules - idle_w * seconds
