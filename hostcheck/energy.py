"""Energy per phase, integrated from what each reader gives over the phase's exact span.

A reader that keeps a cumulative counter (RAPL's `energy_uj`) reports, each tick, the joules
since its previous read (`energy_j`, wrap-corrected by `power.energy_delta_uj`) and when that
previous read was (`energy_from`); the phase's joules are the sum of those differences, which
must tile the span from its entry tick to its exit tick. A reader of instantaneous power
(hwmon, nvidia-smi, NVML) is integrated by the trapezoid rule over its readings, which must
include the entry and the exit tick. A reader that missed the start or the end of a span (it
vanished, its counter wrapped without a known range) gives `Unavailable` for that span, never
a partial sum; the span's total is then unavailable too, naming the reader.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .facts import Unavailable

POWER, ENERGY, ENERGY_FROM = "power_w", "energy_j", "energy_from"
_EPS = 1e-9


@dataclass(frozen=True)
class Reading:
    t: float
    baseline: bool                        # the entry tick: a starting point, not part of the span
    values: dict[str, float]              # one reader's metrics this tick


@dataclass(frozen=True)
class PhaseEnergy:
    """Joules used over `seconds`, summed over the power readers; per reader beside."""

    seconds: float
    joules: float | Unavailable
    by_reader: dict[str, float | Unavailable] = field(default_factory=dict)

    @property
    def watts(self) -> float | Unavailable:
        if isinstance(self.joules, Unavailable):
            return self.joules
        return self.joules / self.seconds if self.seconds > 0 else Unavailable("an empty span")


def reader_joules(name: str, readings: Sequence[Reading], t0: float, t1: float) -> float | Unavailable:
    """One reader's joules over [t0, t1] from its readings in that span (entry tick first)."""
    counted = [r for r in readings if not r.baseline and ENERGY in r.values]
    if counted:
        return _from_counter(name, counted, t0, t1)
    points = [(r.t, r.values[POWER]) for r in readings if POWER in r.values]
    if not points or abs(points[0][0] - t0) > _EPS or abs(points[-1][0] - t1) > _EPS:
        return Unavailable(f"{name} gave no reading at the phase's {_missing_end(points, t0)}")
    return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(points, points[1:]))


def _from_counter(name: str, counted: Sequence[Reading], t0: float, t1: float) -> float | Unavailable:
    at = t0
    for r in counted:
        if abs(r.values[ENERGY_FROM] - at) > _EPS:
            return Unavailable(f"{name}'s energy counter missed {r.values[ENERGY_FROM] - at:+.3f} s "
                               f"of the phase (unreadable, or wrapped with no max_energy_range_uj)")
        at = r.t
    if abs(at - t1) > _EPS:
        return Unavailable(f"{name}'s energy counter gave no reading at the phase's end")
    return sum(r.values[ENERGY] for r in counted)


def _missing_end(points: Sequence[tuple[float, float]], t0: float) -> str:
    return "start" if not points or abs(points[0][0] - t0) > _EPS else "end"


def span_energy(per_reader: dict[str, list[Reading]], power_readers: Sequence[str],
                t0: float, t1: float, no_reader: str) -> PhaseEnergy:
    """The span's joules over every power reader; unavailable with the reasons if any missed it."""
    if not power_readers:
        return PhaseEnergy(t1 - t0, Unavailable(no_reader))
    by = {n: reader_joules(n, per_reader.get(n, []), t0, t1) for n in power_readers}
    missing = [j.reason for j in by.values() if isinstance(j, Unavailable)]
    total: float | Unavailable = (Unavailable("; ".join(missing)) if missing
                                  else sum(j for j in by.values() if not isinstance(j, Unavailable)))
    return PhaseEnergy(t1 - t0, total, by)


def add(parts: Sequence[PhaseEnergy]) -> PhaseEnergy:
    """Several spans of one phase as one: joules add, per reader too, and any unavailable span
    makes the sum (or that reader's) unavailable."""
    seconds = sum(p.seconds for p in parts)
    by: dict[str, float | Unavailable] = {}
    for name in dict.fromkeys(n for p in parts for n in p.by_reader):
        js = [p.by_reader.get(name, Unavailable(f"{name} was not read in every span")) for p in parts]
        gone = [j for j in js if isinstance(j, Unavailable)]
        by[name] = gone[0] if gone else sum(js)  # type: ignore[arg-type]
    missing = [p.joules for p in parts if isinstance(p.joules, Unavailable)]
    if missing:
        return PhaseEnergy(seconds, missing[0], by)
    return PhaseEnergy(seconds, sum(p.joules for p in parts), by)  # type: ignore[misc]
