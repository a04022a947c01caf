"""`appliance bench --soak MINUTES`: sustained mixed load from several clients, to show that
nothing leaks (the kinds of request are `soakmix.py`'s; the report and verdict `soakreport.py`'s).

    start     /metrics read before any request: the server's and each engine's RSS and fds
    warm-up   the mix for a fifth of the time (at most a minute), so caches, allocator pools and
              lazily loaded code settle; then every client hangs up
    warmed    /metrics read once the server is quiet: the baseline that growth is measured from
    run       the mix until the time is up, /metrics sampled every 10 s (the max, and growth as
              it happens)
    end       every client hangs up again; /metrics read once the server is quiet

Growth is judged between two quiet points (warmed and end), both with no client connected:
under load the server holds a socket per client and a buffer per request, so a reading taken
then says nothing about a leak. "Quiet" is when two readings 0.25 s apart agree on every fd
count (closing sockets take a moment to leave), or after 5 s.

Each client thread goes round the kinds in order, the clients starting spread over the round
(with as many clients as kinds, the first request of each covers them all), carrying on from
the warm-up into the run; what each request carries varies (`soakmix`).
"""
from __future__ import annotations

import contextlib
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from .client import BenchError, Target
from .soakmix import Client, Kind, Material, Outcome, kinds_for

SAMPLE_EVERY_S = 10.0
QUIET_STEP_S = 0.25
QUIET_MAX_S = 5.0
SERVER = "server"
ENGINE_METRICS = {"appliance_engine_resident_memory_bytes": "rss_bytes", "appliance_engine_open_fds": "open_fds"}
SERVER_METRICS = {"process_resident_memory_bytes": "rss_bytes", "process_open_fds": "open_fds"}


@dataclass(frozen=True)
class Usage:
    """One process's resources at one reading."""

    rss_bytes: int | None = None
    open_fds: int | None = None


@dataclass(frozen=True)
class Sample:
    """One /metrics reading: "server" and "engine MODEL" by name, and the default model's
    prompt-cache RAM tier (engine RSS that is cache by design, not a leak)."""

    at_s: float
    point: str                                  # start, warmed, during, end
    processes: dict[str, Usage] = field(default_factory=dict)
    cache_ram_bytes: int | None = None


@dataclass(frozen=True)
class SoakPlan:
    minutes: float
    clients: int = 4
    sample_every_s: float = SAMPLE_EVERY_S

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_s(self) -> float:
        return min(60.0, 0.2 * self.seconds)


@dataclass
class SoakResult:
    plan: SoakPlan
    kinds: tuple[Kind, ...]
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    restarts: tuple[int | None, int | None] = (None, None)   # the engine's restart count, start and end
    interrupted: bool = False


# -- reading /metrics ------------------------------------------------------------------------

def parse_metrics(text: str, at_s: float, point: str) -> Sample:
    """The resource figures in a Prometheus text exposition; absent ones stay None."""
    found: dict[str, dict[str, int]] = {}
    cache: int | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SERVER_METRICS:
                found.setdefault(SERVER, {})[SERVER_METRICS[s.name]] = int(s.value)
            elif s.name in ENGINE_METRICS:
                found.setdefault(f"engine {s.labels.get('model', '?')}", {})[ENGINE_METRICS[s.name]] = int(s.value)
            elif s.name == "appliance_prompt_cache_ram_bytes":
                cache = int(s.value)
    return Sample(at_s, point, {name: Usage(**v) for name, v in found.items()}, cache)


class MetricsReader:
    """Reads /metrics over one connection of its own, held for the whole soak so that it counts
    the same at every reading."""

    def __init__(self, target: Target, t0: float) -> None:
        self.target, self.t0 = target, t0

    def read(self, point: str) -> Sample:
        at = round(time.perf_counter() - self.t0, 3)
        try:
            r = self.target.http.get(self.target.url + "/metrics", timeout=30)
        except requests.RequestException:
            return Sample(at, point)
        return parse_metrics(r.text, at, point) if r.status_code == 200 else Sample(at, point)

    def quiet(self, point: str) -> Sample:
        """A reading once the fd counts stop changing (see the module docstring)."""
        last = self.read(point)
        deadline = time.monotonic() + QUIET_MAX_S
        while time.monotonic() < deadline:
            time.sleep(QUIET_STEP_S)
            now = self.read(point)
            if _fds(now) == _fds(last):
                return now
            last = now
        return last


def _fds(s: Sample) -> dict[str, int | None]:
    return {name: u.open_fds for name, u in s.processes.items()}


# -- the load --------------------------------------------------------------------------------

class Soak:
    """Runs a plan against one server: `run()` returns what it saw; `on_outcomes` gets each
    batch of finished requests as the soak goes, in the thread that called `run()` (the caller
    stores them). A host sampler, when given, files its ticks under the phases' names."""

    def __init__(self, target: Target, api_key: str | None, model_id: str, n_ctx: int, plan: SoakPlan,
                 on_outcomes: Callable[[list[Outcome]], None], progress: bool = True,
                 sampler: Any = None) -> None:
        self.target, self.api_key, self.model_id, self.plan = target, api_key, model_id, plan
        self.on_outcomes, self.progress, self.sampler = on_outcomes, progress, sampler
        self.material = Material(target, n_ctx)
        self.result = SoakResult(plan, kinds_for(self.material))
        self.t0 = time.perf_counter()
        self.metrics = MetricsReader(Target(target.url, api_key), self.t0)
        self._done: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        # where each client is in the round of kinds: spread, so a short soak still sends every
        # kind, and carried from the warm-up into the run
        self._next = [i * len(self.result.kinds) // plan.clients for i in range(plan.clients)]
        self._errors: list[BaseException] = []

    def run(self) -> SoakResult:
        res = self.result
        first = self.target.health() or {}
        res.samples.append(self.metrics.quiet("start"))
        try:
            self._phase("warm-up", self.plan.warmup_s, sample=False)
            res.samples.append(self.metrics.quiet("warmed"))
            self._phase("run", self.plan.seconds - self.plan.warmup_s, sample=True)
        except KeyboardInterrupt:
            res.interrupted = True
        res.samples.append(self.metrics.quiet("end"))
        last = self.target.health() or {}
        res.restarts = (first.get("restarts"), last.get("restarts"))
        self.metrics.target.close()
        return res

    def _phase(self, phase: str, seconds: float, sample: bool) -> None:
        """Every client sends until the phase's time is up; the requests under way then finish,
        and the clients hang up."""
        stop = threading.Event()
        deadline = time.monotonic() + seconds
        clients = [Client(self.target.url, self.api_key, self.model_id, self.material, self.t0)
                   for _ in range(self.plan.clients)]
        threads = [threading.Thread(target=self._client, args=(c, i, phase, deadline, stop), daemon=True,
                                    name=f"soak-client-{i}") for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        try:
            with self.sampler.phase(phase) if self.sampler is not None else contextlib.nullcontext():
                self._watch(phase, threads, deadline, sample)
        except KeyboardInterrupt:
            stop.set()
            raise
        finally:
            for t in threads:
                t.join()
            for c in clients:
                c.close()
            self._flush()
        if self._errors:
            raise BenchError(f"a soak client failed: {self._errors[0]!r}") from self._errors[0]

    def _watch(self, phase: str, threads: list[threading.Thread], deadline: float, sample: bool) -> None:
        """While the clients run: store finished requests, read /metrics every interval, show progress."""
        from tqdm import tqdm

        total = max(0.0, deadline - time.monotonic())
        bar = tqdm(total=round(total), disable=not self.progress, file=sys.stderr, unit="s", leave=False,
                   desc=f"soak {phase}", dynamic_ncols=True, mininterval=1.0)
        next_sample = time.monotonic() + self.plan.sample_every_s
        try:
            while any(t.is_alive() for t in threads):
                time.sleep(0.5)
                bar.n = min(round(total), round(total - max(0.0, deadline - time.monotonic())))
                bar.set_postfix(requests=len(self.result.outcomes) + self._done.qsize(), refresh=False)
                bar.refresh()
                if time.monotonic() >= next_sample:
                    self._flush()
                    if sample:
                        self.result.samples.append(self.metrics.read("during"))
                    next_sample += self.plan.sample_every_s
        finally:
            bar.close()

    def _client(self, client: Client, index: int, phase: str, deadline: float, stop: threading.Event) -> None:
        kinds = self.result.kinds
        rng = random.Random(f"{index}-{phase}")
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                kind = kinds[self._next[index] % len(kinds)]
                self._next[index] += 1
                self._done.put(kind.send(client, rng, phase))
        except Exception as e:      # a bug in the soak itself: stop this client and say so at the end
            self._errors.append(e)

    def _flush(self) -> None:
        batch: list[Outcome] = []
        while not self._done.empty():
            batch.append(self._done.get())
        if batch:
            self.result.outcomes.extend(batch)
            self.on_outcomes(batch)
