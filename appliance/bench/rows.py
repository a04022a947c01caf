"""Stored cells grouped into rows, the unit every table, comparison and curve reads: one Row per
planned cell, target and variant, with min / median / max of each metric over its repeats, and
what its kind adds (concurrency's aggregate and batching gain, the agent replay's turns, the
needle's verdict). Rules cited are shared/BENCHMARKING.md's.

A pure function of stored cells. The measuring side's contract: every cell carries
`extra["cell"]`, the label of its planned cell; a row is the cells of one run with the same
(label, target, variant), one per repeat (and for concurrency one per stream), in order of first
appearance. Kind-specific extras: concurrency `stream`, `aggregate_tps`; agent `conversation`,
`turn`; needle `found`, `status`, `expected_status`; any cell `identity` = False when its output
differed from serial.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..store import ResultCell

GAP_FLAG = 0.10          # client vs engine decode gap worth a flag (rule 3)


@dataclass(frozen=True)
class Stat:
    min: float | None
    median: float | None
    max: float | None
    n: int                   # how many cells had a value


@dataclass(frozen=True)
class Row:
    cell: str
    target: str              # served or raw
    variant: str             # "" or the A/B label
    kind: str
    mode: str                # the cells' modes, "+"-joined if they differ
    prompt_set: str
    concurrency: int
    cache_on: bool
    runs: int                # distinct repeats
    prompt_tokens: int       # medians over the cells, as ints
    depth: int
    generated_tokens: int
    ttft_ms: Stat
    prefill_tps: Stat
    engine_prefill_tps: Stat
    client_decode_tps: Stat
    engine_decode_tps: Stat
    extra: dict              # decode_gap, flag_gap, identity_failures + the kind's summary
    prefill_tpj: Stat = Stat(None, None, None, 0)   # tokens per joule, gross (store.ResultCell)
    decode_tpj: Stat = Stat(None, None, None, 0)
    request_j: Stat = Stat(None, None, None, 0)     # joules per request, gross
    energy_note: str = ""    # why a row has no joules (the first cell's reason)


def stat(values: Iterable[float | None]) -> Stat:
    present = [float(v) for v in values if v is not None]
    if not present:
        return Stat(None, None, None, 0)
    return Stat(min(present), statistics.median(present), max(present), len(present))


def rows(cells: Sequence[ResultCell]) -> list[Row]:
    """One Row per (label, target, variant), in order of first appearance."""
    return _with_batching_gain([_row(group) for group in groups(cells)])


def cell_label(c: ResultCell) -> str:
    # Cells stored before labels existed were served sweep cells: name them by their size.
    return str(c.extra.get("cell") or f"{c.kind} p={c.prompt_tokens}")


def groups(cells: Iterable[ResultCell]) -> list[list[ResultCell]]:
    """The cells of each row: the same (label, target, variant, mode), in order of first appearance."""
    by_key: dict[tuple[str, str, str, str], list[ResultCell]] = {}
    for c in cells:
        by_key.setdefault((cell_label(c), c.target, c.variant, c.mode), []).append(c)
    return list(by_key.values())


def joined(values: Iterable[str]) -> str:
    return "+".join(dict.fromkeys(values))


def _median_int(values: Iterable[int]) -> int:
    return int(round(statistics.median(values)))


def _row(cells: list[ResultCell]) -> Row:
    first = cells[0]
    return Row(
        cell=cell_label(first), target=first.target, variant=first.variant, kind=first.kind,
        mode=joined(c.mode for c in cells), prompt_set=joined(c.prompt_set for c in cells),
        concurrency=first.concurrency, cache_on=first.cache_on,
        runs=len({c.repeat_index for c in cells}),
        prompt_tokens=_median_int(c.prompt_tokens for c in cells),
        depth=_median_int(c.depth for c in cells),
        generated_tokens=_median_int(c.generated_tokens for c in cells),
        ttft_ms=stat(c.ttft_ms for c in cells),
        prefill_tps=stat(c.prefill_tps for c in cells),
        engine_prefill_tps=stat(c.engine_prefill_tps for c in cells),
        client_decode_tps=stat(c.client_decode_tps for c in cells),
        engine_decode_tps=stat(c.engine_decode_tps for c in cells),
        extra=_extra(cells),
        prefill_tpj=stat(c.prefill_tpj for c in cells), decode_tpj=stat(c.decode_tpj for c in cells),
        request_j=stat(c.request_j for c in cells),
        energy_note=next((c.energy_note for c in cells if c.request_j is None and c.energy_note), ""))


def _extra(cells: list[ResultCell]) -> dict[str, Any]:
    client = stat(c.client_decode_tps for c in cells).median
    engine = stat(c.engine_decode_tps for c in cells).median
    gap = client / engine - 1 if client is not None and engine else None
    extra = {"decode_gap": gap, "flag_gap": gap is not None and abs(gap) > GAP_FLAG,
             "identity_failures": sum(c.extra.get("identity") is False for c in cells)}
    summary = _SUMMARIES.get(cells[0].kind)
    return extra | summary(cells) if summary else extra


def _concurrency(cells: list[ResultCell]) -> dict[str, Any]:
    # every stream of a repeat carries its group's aggregate: one value per repeat
    per_repeat = {c.repeat_index: c.extra.get("aggregate_tps") for c in cells}
    return {"aggregate_tps": stat(per_repeat.values()), "batching_gain": None}


def turn_of(c: ResultCell) -> int:
    return int(c.extra.get("turn", 0))


def _agent(cells: list[ResultCell]) -> dict[str, Any]:
    """First-turn TTFT, follow-up TTFT median and p95 (numpy's linear percentile), the share of
    follow-up prompt tokens served from cache, and the last turn's median TTFT over the second's
    (the last turn of each conversation in each repeat): near 1 when a turn costs what was added."""
    follow = [c for c in cells if turn_of(c) > 0]
    ttfts = [c.ttft_ms for c in follow]
    prompt = sum(c.prompt_tokens for c in follow)
    last: dict[tuple[int, int], ResultCell] = {}
    for c in cells:
        key = (c.repeat_index, int(c.extra.get("conversation", 0)))
        if key not in last or turn_of(c) > turn_of(last[key]):
            last[key] = c
    second = stat(c.ttft_ms for c in cells if turn_of(c) == 1).median
    last_median = stat(c.ttft_ms for c in last.values()).median
    return {"first_ttft_ms": stat(c.ttft_ms for c in cells if turn_of(c) == 0),
            "followup_ttft_ms_median": stat(ttfts).median,
            "followup_ttft_ms_p95": float(np.percentile(ttfts, 95)) if ttfts else None,
            "cached_share": sum(c.cached_tokens for c in follow) / prompt if prompt else None,
            "last_over_second": last_median / second if second else None}


def _needle_ok(c: ResultCell) -> bool:
    status = c.extra.get("status")
    return status == c.extra.get("expected_status") and (status != 200 or bool(c.extra.get("found")))


def _needle(cells: list[ResultCell]) -> dict[str, Any]:
    return {"found": sum(bool(c.extra.get("found")) for c in cells), "total": len(cells),
            "status": sorted({int(c.extra.get("status", 0)) for c in cells}),
            "expected_status": sorted({int(c.extra.get("expected_status", 0)) for c in cells}),
            "ok": all(_needle_ok(c) for c in cells)}


_SUMMARIES: dict[str, Callable[[list[ResultCell]], dict[str, Any]]] = {
    "concurrency": _concurrency, "agent": _agent, "needle": _needle}


def _with_batching_gain(all_rows: list[Row]) -> list[Row]:
    """Batching gain: aggregate decode over that of the one-stream row of the same target and
    variant (rule 9)."""
    one_stream: dict[tuple[str, str], float | None] = {}
    for r in all_rows:
        if r.kind == "concurrency" and r.concurrency == 1:
            one_stream.setdefault((r.target, r.variant), r.extra["aggregate_tps"].median)
    out = []
    for r in all_rows:
        if r.kind == "concurrency":
            base, agg = one_stream.get((r.target, r.variant)), r.extra["aggregate_tps"].median
            gain = agg / base if agg is not None and base else None
            r = dataclasses.replace(r, extra={**r.extra, "batching_gain": gain})
        out.append(r)
    return out
