"""Prometheus metrics (prometheus-client), one registry per app so several apps can live in
one process (tests).

Counters and histograms are fed by the API layer as requests are served; gauges are read from
the engine's latest scheduler stats at scrape time by a custom collector.

Resources, so a soak (`appliance bench --soak`) or a monitor sees a leak: the server's own
`process_*` metrics (prometheus-client's ProcessCollector, which an app registry does not get by
itself: only the library's global registry has it), and each engine process's resident memory
and open file descriptors by model, read from /proc/<engine pid> at scrape time. Engine
processes are the server's children, so their figures are not in its own.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from appliance.engine.stats import EngineStats, ExpertStats

PREFIX = "appliance"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineCollector:
    """Gauges and engine-side counters from the engine's latest `EngineStats`, read at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], info: Callable[[], object]) -> None:
        self.stats, self.info = stats, info

    def collect(self) -> Iterator:
        s = self.stats() or EngineStats()
        for name, (doc, value) in _gauges(s).items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        for name, (doc, value) in _counters(s).items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        if s.experts is not None:
            yield from _expert_metrics(s.experts)
        batches = GaugeMetricFamily(f"{PREFIX}_decode_batch_steps", "steps by number of decode rows",
                                    labels=["rows"])
        for rows, n in sorted(s.decode_batches.items()):
            batches.add_metric([str(rows)], n)
        yield batches


def _gauges(s: EngineStats) -> dict[str, tuple[str, float]]:
    """name: (help, value) of what the engine holds now."""
    c = s.cache
    return {
        "queue_depth": ("requests waiting for a slot", s.queue_depth),
        "slots_busy": ("slots holding a request", s.slots_busy),
        "slots": ("slots configured", s.n_slots),
        "kv_pool_bytes": ("bytes of the KV pool (n_slots x n_ctx positions; n_ctx with --kv-unified)", s.kv_bytes),
        "kv_pool_tokens": ("positions in the KV pool", s.kv_capacity),
        "kv_used_tokens": ("positions of the KV pool holding a live request", s.kv_tokens),
        "prompt_cache_slot_tokens": ("prompt positions kept in idle slots for reuse", c.cached_tokens),
        "prompt_cache_ram_bytes": ("bytes of saved prompt states in the RAM tier", c.ram_bytes),
        "prompt_cache_ram_entries": ("saved prompt states in the RAM tier", c.ram_entries),
        "prompt_cache_ram_pinned_bytes": ("bytes of pinned prompt states in the RAM tier",
                                          c.ram_pinned_bytes),
        "prompt_cache_disk_bytes": ("bytes of saved prompt states in the disk tier", c.disk_bytes),
        "prompt_cache_disk_entries": ("saved prompt states in the disk tier", c.disk_entries),
        "prompt_cache_disk_pinned_bytes": ("bytes of pinned prompt states in the disk tier",
                                           c.disk_pinned_bytes),
        "prompt_cache_disk_queued_bytes": ("bytes of prompt states waiting for the disk tier's writer",
                                           c.disk_queued_bytes),
        "prompt_cache_unsettled_tokens": ("reply tokens of idle slots not settled yet (idle work left)",
                                          c.unsettled_tokens),
        "prompt_cache_unsaved_slots": ("idle slots whose kept state is not handed to the disk tier yet "
                                       "(idle work left)", c.unsaved_slots),
    }


def _counters(s: EngineStats) -> dict[str, tuple[str, float]]:
    """name: (help, value) of what the engine has done since it started."""
    c, sp = s.cache, s.spec
    return {
        "engine_steps": ("scheduler steps run", s.steps),
        "prompt_cache_hit_tokens": ("prompt tokens served from the prompt cache", c.cache_hit_tokens),
        "prompt_cache_inexact_hits": ("requests that --prompt-cache fast served more of than exact reuse "
                                      "would (their timings say cache_reuse: inexact)", c.inexact_hits),
        "prompt_cache_ram_hit_tokens": ("prompt tokens restored from the RAM tier", c.ram_hit_tokens),
        "prompt_cache_ram_hits": ("requests restored from the RAM tier", c.ram_hits),
        "prompt_cache_disk_hit_tokens": ("prompt tokens restored from the disk tier", c.disk_hit_tokens),
        "prompt_cache_disk_hits": ("requests restored from the disk tier", c.disk_hits),
        "prompt_cache_settled_tokens": ("reply tokens recomputed while idle as a prompt computes them, "
                                        "so that the next turn reuses them exactly", c.settled_tokens),
        "prompt_cache_disk_skipped": ("prompt states not written to disk: the writer's queue was full",
                                      c.disk_skipped),
        "prompt_cache_disk_write_errors": ("prompt state writes that failed (each loses that state)",
                                           c.disk_write_errors),
        "draft_tokens_proposed": ("tokens proposed by speculative drafting", sp.draft_proposed),
        "draft_tokens_accepted": ("drafted tokens accepted by verification", sp.draft_accepted),
        "speculative_steps": ("decode steps that verified a draft", sp.spec_steps),
        "speculative_tokens_committed": ("tokens committed by steps that verified a draft",
                                         sp.spec_committed),
    }


def _expert_metrics(e: ExpertStats) -> Iterator:
    """The torch runner's expert cache: its pool, and what it copied and computed where."""
    for name, doc, value in (("expert_cache_slots", "expert slots in the device pool", e.slots),
                             ("expert_cache_resident", "expert slots holding an expert", e.resident),
                             ("expert_copy_bandwidth_bytes_per_second",
                              "host-to-device copy bandwidth of one expert, measured at start",
                              e.copy_gb_per_s * 1e9)):
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
    for name, doc, value in (("expert_cache_lookups", "(token, expert) pairs the router chose", e.lookups),
                             ("expert_cache_hits", "... whose expert was in the device pool", e.hits),
                             ("expert_cache_misses", "... whose expert was not", e.lookups - e.hits),
                             ("expert_cache_copies", "experts copied into the device pool", e.copies),
                             ("expert_cache_copied_bytes", "bytes of experts copied into the device pool",
                              e.bytes_copied),
                             ("expert_host_rows", "rows computed on the host from the experts' host copies",
                              e.host_rows)):
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def process_usage(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open file descriptors) of a process, or None when it is gone or hidden."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.memory_info().rss, proc.num_fds()
    except (psutil.Error, AttributeError):      # AttributeError: num_fds exists on POSIX only
        return None


class EngineProcessCollector:
    """Each loaded model's engine process: resident memory and open fds, labelled by model."""

    def __init__(self, pids: Callable[[], Mapping[str, int | None]]) -> None:
        self.pids = pids

    def collect(self) -> Iterator:
        rss = GaugeMetricFamily(f"{PREFIX}_engine_resident_memory_bytes",
                                "resident memory of the model's engine process", labels=["model"])
        fds = GaugeMetricFamily(f"{PREFIX}_engine_open_fds",
                                "open file descriptors of the model's engine process", labels=["model"])
        for model, pid in sorted(self.pids().items()):
            usage = process_usage(pid) if pid else None
            if usage is not None:
                rss.add_metric([model], usage[0])
                fds.add_metric([model], usage[1])
        yield rss
        yield fds


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None], info: Callable[[], object],
                 engine_pids: Callable[[], Mapping[str, int | None]] = dict) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)    # process_resident_memory_bytes, process_open_fds, ...
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "from request arrival to the first content token", buckets=LATENCY_BUCKETS, registry=r)
        self.token_gap = Histogram(f"{PREFIX}_inter_token_seconds", "time between content deltas of a stream",
                                   buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.duration = Histogram(f"{PREFIX}_request_duration_seconds", "from arrival to the last byte",
                                  buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(stats, info))
        r.register(EngineProcessCollector(engine_pids))

    def render(self) -> bytes:
        return generate_latest(self.registry)
