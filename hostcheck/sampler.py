"""A background sampler of power and clocks, reduced to medians per measured phase.

    sampler = Sampler.for_host(interval_s=0.1)
    with sampler:                          # start() ... stop(); both idempotent
        with sampler.phase("prefill"):
            run_prefill()
        with sampler.phase("decode"):
            run_decode()
    sampler.summary()   # {"prefill": PhaseStats(median_power_w=84.1, ...), "decode": ...}
    sampler.energy()    # {"prefill": PhaseEnergy(seconds=.., joules=..), ...} (energy.py)

`with sampler.phase(name) as span` gives the span; `sampler.span_energy(span)` is its joules
once it has ended, which is how bench gives each cell its own prefill and decode energy.

A thread ticks every `interval_s`; each tick asks every reader for its metrics and files them
under the phase in force (ticks outside a phase are dropped). Entering and leaving a phase
also tick, in the caller's thread: an energy counter's difference then starts at the phase's
first instant and ends at its last, and a phase shorter than one interval still gets a
reading. The entry tick is kept as the span's starting point (its power, its counter read) but
counts in no median. Without start() only those boundary ticks happen, which for RAPL is the phase's mean
power. Phases do not nest; a phase entered twice accumulates. A boundary tick costs what the
readers cost (microseconds for sysfs, tens of milliseconds when nvidia-smi is run), so start
the clock of the measured work inside the `with`.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .energy import ENERGY, PhaseEnergy, Reading, add, span_energy
from .facts import Runner, run_command
from .readers import CPU_MHZ, GPU_MHZ, POWER, Reader, default_readers, energy_unavailable


@dataclass(frozen=True)
class PhaseStats:
    median_power_w: float | None
    median_cpu_mhz: float | None
    median_gpu_mhz: float | None
    n_samples: int                  # ticks filed under the phase (with or without values)


@dataclass(frozen=True)
class Sample:
    t: float
    phase: str
    values: dict[str, dict[str, float]]   # reader name -> {metric: value} this tick
    span: int = 0                         # index of the phase span it was filed under
    baseline: bool = False                # the span's entry tick: a starting point only


@dataclass
class Span:
    """One entry into a phase: [t0, t1] on the sampler's clock (t1 is None while it runs)."""

    name: str
    index: int
    t0: float
    t1: float | None = None


class Sampler:
    def __init__(self, *readers: Reader, interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic,
                 no_energy: str = "no power or energy reader"):
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.readers = readers
        self._names = _unique([getattr(r, "name", type(r).__name__) for r in readers])
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._phase: Span | None = None
        self._spans: list[Span] = []
        # readers integrated in every span: those that say they give power, and any that has
        self._powered = {n for n, r in zip(self._names, readers) if getattr(r, "gives_power", False)}
        self.no_energy = no_energy or "no power reader gave a reading"
        self._samples: list[Sample] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def for_host(cls, root: str | Path = "/", run: Runner = run_command,
                 interval_s: float = 0.1) -> Sampler:
        readers = default_readers(root, run)
        return cls(*readers, interval_s=interval_s, no_energy=energy_unavailable(readers, root, run))

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Sampler:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="hostcheck-sampler",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval_s)

    # -- sampling ----------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        with self._lock:
            if self._phase is not None:
                raise RuntimeError(f"phase {name!r} entered inside phase {self._phase.name!r}")
            span = Span(name, len(self._spans), self._clock())
            self._spans.append(span)
            self._phase = span
            self._tick_locked(span.t0, baseline=True)   # energy differences start here
        try:
            yield span
        finally:
            with self._lock:
                span.t1 = self._clock()
                self._tick_locked(span.t1)  # the phase's last reading, up to this instant
                self._phase = None

    def tick(self) -> None:
        """Take one sample now (the thread calls this every interval_s)."""
        with self._lock:
            self._tick_locked()

    def _tick_locked(self, now: float | None = None, baseline: bool = False) -> None:
        now = self._clock() if now is None else now
        readings: dict[str, dict[str, float]] = {}
        for name, reader in zip(self._names, self.readers):
            try:
                values = reader.read(now)
            except Exception:  # noqa: BLE001 - a faulty reader must not kill the sampler
                continue
            if values:
                readings[name] = dict(values)
                if POWER in values or ENERGY in values:
                    self._powered.add(name)
        if self._phase is not None:
            self._samples.append(Sample(now, self._phase.name, readings, self._phase.index, baseline))

    # -- results -----------------------------------------------------------------------------

    @property
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def summary(self) -> dict[str, PhaseStats]:
        """Per phase, in order of first entry: the median of each metric over its ticks."""
        by_phase: dict[str, list[Sample]] = {}
        for s in self.samples:
            by_phase.setdefault(s.phase, []).append(s)
        return {name: _reduce([s for s in ss if not s.baseline]) for name, ss in by_phase.items()}

    def span_energy(self, span: Span) -> PhaseEnergy:
        """The joules of one ended span (energy.py says how each reader's are integrated)."""
        if span.t1 is None:
            raise RuntimeError(f"phase {span.name!r} has not ended")
        with self._lock:
            samples = [s for s in self._samples if s.span == span.index]
            powered = [n for n in self._names if n in self._powered]
        per_reader: dict[str, list[Reading]] = {}
        for s in samples:
            for name, values in s.values.items():
                per_reader.setdefault(name, []).append(Reading(s.t, s.baseline, values))
        return span_energy(per_reader, powered, span.t0, span.t1, self.no_energy)

    def energy(self) -> dict[str, PhaseEnergy]:
        """Per phase, in order of first entry: its ended spans' joules added up."""
        by_phase: dict[str, list[PhaseEnergy]] = {}
        for span in [s for s in self._spans if s.t1 is not None]:
            by_phase.setdefault(span.name, []).append(self.span_energy(span))
        return {name: add(parts) for name, parts in by_phase.items()}


def _reduce(samples: list[Sample]) -> PhaseStats:
    """Median per reader first, so a tick where one sensor missed does not drop its watts;
    then power adds up across readers (CPU package + GPU board), clocks take the median."""
    by_metric: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        for name, values in s.values.items():
            for metric, v in values.items():
                by_metric.setdefault(metric, {}).setdefault(name, []).append(v)

    def medians(metric: str) -> list[float]:
        return [statistics.median(vs) for vs in by_metric.get(metric, {}).values()]

    power, cpu, gpu = medians(POWER), medians(CPU_MHZ), medians(GPU_MHZ)
    return PhaseStats(median_power_w=sum(power) if power else None,
                      median_cpu_mhz=statistics.median(cpu) if cpu else None,
                      median_gpu_mhz=statistics.median(gpu) if gpu else None,
                      n_samples=len(samples))


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out
