"""What a soak concluded (`appliance bench --soak`): requests by kind and HTTP status, TTFT p50
and p99 of the streamed kinds, each process's RSS and open fds at the start, after warm-up, at
the end and at most, and the verdict.

    FAIL    an answer its kind does not expect: any 5xx but a 503 queue_full (a 500, an engine
            crash's 503, an error inside a 200 stream), a request with no answer at all, a bad
            body accepted, an over-context prompt served; or the engine restarted
    LEAK?   between the two quiet readings (warmed and end, soak.py) a process's RSS grew by more
            than max(10 %, 32 MiB), an engine's net of its prompt-cache RAM tier (which grows by
            design up to its budget); or any process's open fds grew at all
    PASS    neither; `appliance bench --soak` exits 0 only then

Stored form (one run of kind "soak"): each request is a cell of kind "soak", labelled
"soak KIND", whose ttft_ms is the time to the first content for streamed kinds and to the whole
answer otherwise, with extra status, code, phase, latency_ms, at_s; the /metrics readings, the
plan and the engine restarts are in the host record under "soak". `from_stored` rebuilds the
report from those, so `appliance results RUN` shows what the run printed.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..store import HostRecord, ResultCell
from .soak import Sample, SoakPlan, SoakResult, Usage
from .soakmix import BY_NAME, Outcome, expected

RSS_TOLERANCE = 0.10
RSS_FLOOR_BYTES = 32 * 2**20
MIB = 2**20


@dataclass(frozen=True)
class KindRow:
    kind: str
    expects: str
    requests: int
    statuses: dict[str, int]          # by Outcome.status_key
    unexpected: int
    ttft_p50_ms: float | None         # streamed kinds' 200s
    ttft_p99_ms: float | None
    answer_p50_ms: float | None       # to the whole answer (or the hang-up)
    answer_p99_ms: float | None       # a stall shows here
    cached_share: float | None        # prompt tokens served from the prompt cache, over the 200s


@dataclass(frozen=True)
class ProcessRow:
    name: str                         # server, or engine MODEL
    rss: tuple[int | None, ...]       # start, warmed, end, max
    fds: tuple[int | None, ...]
    rss_growth: int | None            # end - warmed (an engine: net of its cache tier's growth)
    cache_growth: int | None          # the prompt-cache RAM tier's growth, taken off an engine's
    fd_growth: int | None
    rss_flag: bool
    fd_flag: bool


@dataclass(frozen=True)
class SoakReport:
    plan: SoakPlan
    kinds: list[KindRow]
    processes: list[ProcessRow]
    restarts: tuple[int | None, int | None]
    interrupted: bool
    failures: list[str]
    leaks: list[str]
    notes: list[str]

    @property
    def verdict(self) -> str:
        return "FAIL" if self.failures else "LEAK?" if self.leaks else "PASS"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"


# -- building ------------------------------------------------------------------------------

def build(result: SoakResult) -> SoakReport:
    rows = [_kind_row(k.name, k.expects, [o for o in result.outcomes if o.kind == k.name]) for k in result.kinds]
    processes, notes = _processes(result.samples)
    failures = [f"{r.kind}: {r.unexpected} of {r.requests} answered otherwise than {r.expects} "
                f"({_statuses(r.statuses)})" for r in rows if r.unexpected]
    before, after = result.restarts
    if before is not None and after is not None and after > before:
        failures.append(f"the engine restarted {after - before} time(s)")
    leaks = [f"{p.name}: RSS grew {_mib(p.rss_growth, signed=True)} after warm-up" for p in processes if p.rss_flag]
    leaks += [f"{p.name}: open fds grew by {p.fd_growth} after warm-up" for p in processes if p.fd_flag]
    notes += [f"{r.kind}: no requests were sent (a soak too short for the mix)" for r in rows if not r.requests]
    if result.interrupted:
        notes.append("interrupted before its time was up")
    return SoakReport(result.plan, rows, processes, result.restarts, result.interrupted, failures, leaks, notes)


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _kind_row(name: str, expects: str, found: list[Outcome]) -> KindRow:
    ok = [o for o in found if o.status == 200]
    ttfts = [o.ttft_ms for o in ok if o.ttft_ms is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    statuses = dict(sorted(Counter(o.status_key for o in found).items()))
    return KindRow(name, expects, len(found), statuses, sum(not expected(expects, o) for o in found),
                   _percentile(ttfts, 50), _percentile(ttfts, 99), _percentile([o.latency_ms for o in found], 50),
                   _percentile([o.latency_ms for o in found], 99),
                   sum(o.cached_tokens for o in ok) / prompt if prompt else None)


def _at(samples: Sequence[Sample], point: str) -> Sample | None:
    return next((s for s in samples if s.point == point), None)


def _processes(samples: Sequence[Sample]) -> tuple[list[ProcessRow], list[str]]:
    names = list(dict.fromkeys(n for s in samples for n in s.processes))
    if not names:
        return [], ["no process figures at /metrics (a server without process_* metrics): no leak check"]
    start, warmed, end = (_at(samples, p) for p in ("start", "warmed", "end"))
    notes = [] if warmed else ["no reading after warm-up: growth not judged"]
    engines = [n for n in names if n != "server"]
    cache = _delta(warmed.cache_ram_bytes, end.cache_ram_bytes) if warmed and end and len(engines) == 1 else None
    rows = [_process_row(n, samples, start, warmed, end, cache if n in engines else None) for n in names]
    return rows, notes


def _process_row(name: str, samples: Sequence[Sample], start: Sample | None, warmed: Sample | None,
                 end: Sample | None, cache: int | None) -> ProcessRow:
    def usage(s: Sample | None) -> Usage:
        return s.processes.get(name, Usage()) if s else Usage()

    def column(attr: str) -> tuple[int | None, ...]:
        seen = [v for s in samples if (v := getattr(usage(s), attr)) is not None]
        return (*(getattr(usage(s), attr) for s in (start, warmed, end)), max(seen) if seen else None)

    rss, fds = column("rss_bytes"), column("open_fds")
    rss_growth = _delta(rss[1], rss[2])
    if rss_growth is not None and cache is not None:
        rss_growth -= max(0, cache)
    fd_growth = _delta(fds[1], fds[2])
    limit = max(RSS_TOLERANCE * (rss[1] or 0), RSS_FLOOR_BYTES)
    return ProcessRow(name, rss, fds, rss_growth, cache, fd_growth,
                      rss_growth is not None and rss_growth > limit, fd_growth is not None and fd_growth > 0)


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


# -- storing -------------------------------------------------------------------------------

def to_cells(outcomes: Sequence[Outcome], clients: int) -> list[ResultCell]:
    return [ResultCell(mode="serial", prompt_set=o.prompt_set, depth=o.prompt_tokens, prompt_tokens=o.prompt_tokens,
                       generated_tokens=o.generated_tokens,
                       ttft_ms=o.ttft_ms if o.ttft_ms is not None else o.latency_ms,
                       prefill_tps=None, client_decode_tps=None, engine_decode_tps=None, tokens_per_step=None,
                       concurrency=clients, cache_on=True, cached_tokens=o.cached_tokens, kind="soak",
                       extra={"cell": f"soak {o.kind}", "status": o.status, "code": o.code, "phase": o.phase,
                              "latency_ms": round(o.latency_ms, 3), "at_s": o.at_s, "streamed": o.ttft_ms is not None})
            for o in outcomes]


def record(result: SoakResult) -> dict[str, Any]:
    """What goes under "soak" in the run's host record."""
    return {"minutes": result.plan.minutes, "clients": result.plan.clients, "kinds": [k.name for k in result.kinds],
            "samples": [asdict(s) for s in result.samples], "restarts": list(result.restarts),
            "interrupted": result.interrupted}


def from_stored(host: HostRecord | None, cells: Sequence[ResultCell]) -> SoakReport | None:
    soak = (host.snapshot.get("soak") if host else None) or None
    if soak is None:
        return None
    outcomes = [Outcome(c.extra["cell"].removeprefix("soak "), c.extra.get("phase", "run"), c.extra.get("at_s", 0.0),
                        int(c.extra.get("status", 0)), c.extra.get("code", ""), c.extra.get("latency_ms", c.ttft_ms),
                        c.ttft_ms if c.extra.get("streamed") else None, c.prompt_set, c.prompt_tokens,
                        c.cached_tokens, c.generated_tokens) for c in cells if c.kind == "soak"]
    samples = [Sample(s["at_s"], s["point"], {n: Usage(**u) for n, u in s["processes"].items()},
                      s.get("cache_ram_bytes")) for s in soak["samples"]]
    kinds = tuple(BY_NAME[k] for k in soak["kinds"] if k in BY_NAME)
    result = SoakResult(SoakPlan(soak["minutes"], soak["clients"]), kinds, outcomes, samples,
                        tuple(soak["restarts"]), soak["interrupted"])
    return build(result)


# -- rendering -----------------------------------------------------------------------------

def render(report: SoakReport) -> list[str]:
    """The report as markdown lines: requests by kind, resources by process, the verdict."""
    p = report.plan
    n = sum(r.requests for r in report.kinds)
    lines = [f"### Soak: {p.minutes:g} min, {p.clients} clients (warm-up {p.warmup_s:.0f} s), {n:,} requests", ""]
    body = [[r.kind, f"{r.requests:,}", _statuses(r.statuses), r.expects, str(r.unexpected) + (" !" * bool(r.unexpected)),
             _ms(r.ttft_p50_ms), _ms(r.ttft_p99_ms), _ms(r.answer_p50_ms), _ms(r.answer_p99_ms),
             "-" if r.cached_share is None else f"{r.cached_share:.0%}"] for r in report.kinds]
    lines += _table(["kind", "requests", "by status", "expects", "unexpected", "ttft p50 ms", "ttft p99 ms",
                     "answer p50 ms", "answer p99 ms", "prompt from cache"], body) + [""]
    if report.processes:
        body = [[r.name, *(_mib(v) for v in r.rss), _rss_growth(r), *(_int(v) for v in r.fds),
                 _signed(r.fd_growth) + (" !" * r.fd_flag)] for r in report.processes]
        lines += _table(["process", "RSS start", "warmed", "end", "max", "RSS growth after warm-up", "fds start",
                         "warmed", "end", "max", "fd growth"], body) + [""]
    lines += [f"- {note}" for note in report.notes]
    lines += [f"- engine restarts during the soak: {_restarts(report.restarts)}", "", verdict_line(report)]
    return lines


def verdict_line(report: SoakReport) -> str:
    if report.passed:
        return (f"Verdict: PASS: every kind answered as expected, no engine restart, RSS within "
                f"max({RSS_TOLERANCE:.0%}, {RSS_FLOOR_BYTES // MIB} MiB) of the warmed reading, no fd growth.")
    return f"Verdict: {report.verdict}: " + "; ".join(report.failures + report.leaks) + "."


def _statuses(statuses: Mapping[str, int]) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in statuses.items()) or "-"


def _restarts(r: tuple[int | None, int | None]) -> str:
    return "unknown" if r[0] is None or r[1] is None else str(r[1] - r[0])


def _rss_growth(r: ProcessRow) -> str:
    text = _mib(r.rss_growth, signed=True) + (" !" if r.rss_flag else "")
    return text + (f" (net of prompt cache {_mib(r.cache_growth, signed=True)})" if r.cache_growth else "")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _int(v: int | None) -> str:
    return "-" if v is None else str(v)


def _signed(v: int | None) -> str:
    return "-" if v is None else f"{v:+d}"


def _mib(v: int | None, signed: bool = False) -> str:
    return "-" if v is None else f"{v / MIB:{'+' if signed else ''},.1f} MiB"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(line) + " |" for line in body)]
