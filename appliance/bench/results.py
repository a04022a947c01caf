"""What `appliance bench`, `sweep` and `results` print: stored cells grouped into rows with
min / median / max, rendered as markdown (beginning with the run's conditions), JSON or CSV;
A/B and run-against-run comparisons by pairwise ratios; job-time estimates from the stored
prefill and decode curves; and a plot of those curves. Rules cited are shared/BENCHMARKING.md's.

Everything here is a pure function of stored data (RunInfo, HostRecord, ResultCell lists).
The measuring side's contract: every cell carries `extra["cell"]`, the label of its planned
cell; a row is the cells of one run with the same (label, target, variant), one per repeat
(and for concurrency one per stream), in order of first appearance. Kind-specific extras:
concurrency `stream`, `aggregate_tps`; agent `conversation`, `turn`; needle `found`, `status`,
`expected_status`; any cell `identity` = False when its output differed from serial.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..store import HostRecord, ResultCell, RunInfo, RunStatus, Store

GAP_FLAG = 0.10          # client vs engine decode gap worth a flag (rule 3)
GIB = 2**30
KIND_TITLES = {
    "sweep": "Sweep: prefill at each prompt size, decode at that depth",
    "prompt": "Prompt sets: decode by kind of text",
    "depth": "Depth: decode after a long context",
    "concurrency": "Concurrency: several streams at once, per-stream rates",
    "agent": "Agent replay: every turn",
    "agent-restart": "Agent replay: the next turn after a server restart",
    "agent-cold": "Agent replay: cold requests at the conversation's depth",
    "needle": "Context-length verification",
}
CURVE_KINDS = ("sweep", "prompt", "depth")
COMPARED = ("ttft_ms", "prefill_tps", "client_decode_tps", "engine_decode_tps")


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


def stat(values: Iterable[float | None]) -> Stat:
    present = [float(v) for v in values if v is not None]
    if not present:
        return Stat(None, None, None, 0)
    return Stat(min(present), statistics.median(present), max(present), len(present))


# -- rows ------------------------------------------------------------------------------------

def rows(cells: Sequence[ResultCell]) -> list[Row]:
    """One Row per (label, target, variant), in order of first appearance."""
    return _with_batching_gain([_row(group) for group in _groups(cells)])


def _label(c: ResultCell) -> str:
    # Cells stored before labels existed were served sweep cells: name them by their size.
    return str(c.extra.get("cell") or f"{c.kind} p={c.prompt_tokens}")


def _groups(cells: Iterable[ResultCell]) -> list[list[ResultCell]]:
    groups: dict[tuple[str, str, str], list[ResultCell]] = {}
    for c in cells:
        groups.setdefault((_label(c), c.target, c.variant), []).append(c)
    return list(groups.values())


def _joined(values: Iterable[str]) -> str:
    return "+".join(dict.fromkeys(values))


def _median_int(values: Iterable[int]) -> int:
    return int(round(statistics.median(values)))


def _row(cells: list[ResultCell]) -> Row:
    first = cells[0]
    return Row(
        cell=_label(first), target=first.target, variant=first.variant, kind=first.kind,
        mode=_joined(c.mode for c in cells), prompt_set=_joined(c.prompt_set for c in cells),
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
        extra=_extra(cells))


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


def _turn(c: ResultCell) -> int:
    return int(c.extra.get("turn", 0))


def _agent(cells: list[ResultCell]) -> dict[str, Any]:
    """First-turn TTFT, follow-up TTFT median and p95 (numpy's linear percentile), the share of
    follow-up prompt tokens served from cache, and the last turn's median TTFT over the second's
    (the last turn of each conversation in each repeat): near 1 when a turn costs what was added."""
    follow = [c for c in cells if _turn(c) > 0]
    ttfts = [c.ttft_ms for c in follow]
    prompt = sum(c.prompt_tokens for c in follow)
    last: dict[tuple[int, int], ResultCell] = {}
    for c in cells:
        key = (c.repeat_index, int(c.extra.get("conversation", 0)))
        if key not in last or _turn(c) > _turn(last[key]):
            last[key] = c
    second = stat(c.ttft_ms for c in cells if _turn(c) == 1).median
    last_median = stat(c.ttft_ms for c in last.values()).median
    return {"first_ttft_ms": stat(c.ttft_ms for c in cells if _turn(c) == 0),
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


# -- compare ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ratio:
    a: float | None          # side A's median over its cells
    b: float | None
    ratio: float | None      # median over matched pairs of B/A (not b / a)
    pairs: int


@dataclass(frozen=True)
class CompareRow:
    cell: str
    target: str
    kind: str
    mode: str
    ttft_ms: Ratio
    prefill_tps: Ratio
    client_decode_tps: Ratio
    engine_decode_tps: Ratio


def compare(cells_a: Sequence[ResultCell], cells_b: Sequence[ResultCell],
            label_a: str = "A", label_b: str = "B") -> list[CompareRow]:
    """Rows matched by (label, target), in side A's order; rows on one side only are left out.
    Cells pair up by repeat (and stream, conversation, turn), measured side by side (rule 7).
    Each side must hold one variant: filter an A/B run with `of_variant` first."""
    side_b = _keyed(cells_b, label_b)
    out = []
    for key, group_a in _keyed(cells_a, label_a).items():
        if (group_b := side_b.get(key)) is None:
            continue
        ratios = {m: _ratio(group_a, group_b, m) for m in COMPARED}
        out.append(CompareRow(cell=key[0], target=key[1], kind=group_a[0].kind,
                              mode=_joined(c.mode for c in group_a + group_b), **ratios))
    return out


def variants(cells: Iterable[ResultCell]) -> list[str]:
    """The run's A/B labels in order of first appearance (empty for a run without variants)."""
    return [v for v in dict.fromkeys(c.variant for c in cells) if v]


def of_variant(cells: Iterable[ResultCell], variant: str) -> list[ResultCell]:
    return [c for c in cells if c.variant == variant]


def _keyed(cells: Sequence[ResultCell], label: str) -> dict[tuple[str, str], list[ResultCell]]:
    out: dict[tuple[str, str], list[ResultCell]] = {}
    for group in _groups(cells):
        key = (_label(group[0]), group[0].target)
        if key in out:
            raise ValueError(f"side {label} holds {key[0]!r} ({key[1]}) in several variants; "
                             "compare one variant at a time")
        out[key] = group
    return out


def _pair_key(c: ResultCell) -> tuple[int, int, int, int]:
    e = c.extra
    return (c.repeat_index, int(e.get("stream", 0)), int(e.get("conversation", 0)), _turn(c))


def _ratio(cells_a: list[ResultCell], cells_b: list[ResultCell], metric: str) -> Ratio:
    a = {_pair_key(c): getattr(c, metric) for c in cells_a}
    b = {_pair_key(c): getattr(c, metric) for c in cells_b}
    ratios = [b[k] / a[k] for k in a if k in b and a[k] and b[k] is not None]
    return Ratio(a=stat(a.values()).median, b=stat(b.values()).median,
                 ratio=statistics.median(ratios) if ratios else None, pairs=len(ratios))


# -- estimate --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    decode_s: float
    total_s: float
    prefill_tps: float
    decode_tps_start: float
    decode_tps_end: float
    extrapolated: bool                   # some point lay outside the measured curve
    source_run: int
    prefill_range: tuple[int, int] = (0, 0)   # prompt tokens the prefill curve spans
    decode_range: tuple[int, int] = (0, 0)    # depths the decode curve spans


Curve = list[tuple[int, float]]


def curves(cells: Sequence[ResultCell], target: str = "served") -> tuple[Curve, Curve]:
    """(prompt tokens, median prefill tok/s) and (depth, median client decode tok/s), sorted, one
    point per row, from the target's serial, cache-off, one-stream sweep/prompt/depth rows of
    variant "" or "A" (the baseline of an A/B run)."""
    usable = [r for r in rows(cells)
              if r.target == target and r.variant in ("", "A") and r.kind in CURVE_KINDS
              and r.mode == "serial" and not r.cache_on and r.concurrency == 1]
    prefill = [(r.prompt_tokens, r.prefill_tps.median) for r in usable
               if r.prefill_tps.median and r.prefill_tps.median > 0]
    decode = [(r.depth, r.client_decode_tps.median) for r in usable
              if r.client_decode_tps.median and r.client_decode_tps.median > 0]
    return sorted(prefill), sorted(decode)


def estimate(cells: Sequence[ResultCell], prompt_tokens: int, output_tokens: int,
             run_id: int = 0) -> Estimate:
    """total = P / prefill(P) + sum over i < O of 1 / decode(P + i) (rule 6). Between measured
    points the rates are linear; beyond them the end value is held and `extrapolated` is set."""
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError("prompt and output tokens must not be negative")
    prefill, decode = curves(cells)
    missing = [name for name, c in (("prefill", prefill), ("decode", decode)) if not c]
    if missing:
        raise ValueError(f"run {run_id} has no usable {' or '.join(missing)} curve: it needs "
                         "served, serial, cache-off, one-stream sweep, prompt or depth rows")
    px, py = _merged(prefill)
    dx, dy = _merged(decode)
    positions = prompt_tokens + np.arange(max(output_tokens, 1))   # [O] context positions
    decode_rates = np.interp(positions, dx, dy)                     # [O] tok/s at each
    prefill_rate = float(np.interp(prompt_tokens, px, py))
    prefill_s = prompt_tokens / prefill_rate
    decode_s = float(np.sum(1.0 / decode_rates)) if output_tokens else 0.0
    outside = (prompt_tokens < px[0] or prompt_tokens > px[-1]
               or (output_tokens > 0 and (positions[0] < dx[0] or positions[-1] > dx[-1])))
    return Estimate(prompt_tokens, output_tokens, prefill_s, decode_s, prefill_s + decode_s,
                    prefill_rate, float(decode_rates[0]), float(decode_rates[-1]), bool(outside),
                    run_id, (int(px[0]), int(px[-1])), (int(dx[0]), int(dx[-1])))


def _merged(curve: Curve) -> tuple[np.ndarray, np.ndarray]:
    """Rows at the same x (prompt sets of one length) become one point, their median."""
    by_x: dict[int, list[float]] = {}
    for x, y in curve:
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return np.array(xs, dtype=float), np.array([statistics.median(by_x[x]) for x in xs])


def estimate_from_store(store: Store, prompt_tokens: int, output_tokens: int,
                        run_id: int | None = None) -> Estimate:
    """From the given run, or from the newest run whose cells give both curves."""
    if run_id is not None:
        return estimate(store.results(run_id), prompt_tokens, output_tokens, run_id)
    for info in reversed(store.runs()):
        cells = store.results(info.id)
        if all(curves(cells)):
            return estimate(cells, prompt_tokens, output_tokens, info.id)
    raise ValueError("no stored run has prefill and decode curves: run `appliance sweep` first")


def render_estimate(e: Estimate) -> str:
    text = (f"prefill {e.prompt_tokens:,} tokens at {e.prefill_tps:,.0f} tok/s: "
            f"{_secs(e.prefill_s)}; decode {e.output_tokens:,} tokens at "
            f"{e.decode_tps_start:,.0f}..{e.decode_tps_end:,.0f} tok/s: {_secs(e.decode_s)}; "
            f"total {_secs(e.total_s)} (curves of run {e.source_run})")
    if e.extrapolated:
        text += (f"\nwarning: outside the measured curves (prefill {e.prefill_range[0]:,}.."
                 f"{e.prefill_range[1]:,} tokens, decode at depth {e.decode_range[0]:,}.."
                 f"{e.decode_range[1]:,}); the nearest measured rate was held, so this is a guess")
    return text


def _secs(s: float) -> str:
    return f"{s:,.1f} s" if s >= 1 else f"{s:.2f} s"


# -- plot ------------------------------------------------------------------------------------

def plot(runs: Sequence[tuple[RunInfo, Sequence[ResultCell]]], path: Any) -> None:
    """Decode tok/s against depth and prefill tok/s against prompt tokens, one line per run and
    target (raw dashed), written as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'appliance[plot]'") from e
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)    # Agg, without pyplot's global state
    decode_ax, prefill_ax = fig.subplots(1, 2)
    for i, (info, cells) in enumerate(runs):
        for target, style in (("served", "-"), ("raw", "--")):
            prefill, decode = curves(cells, target)
            label = f"run {info.id} {info.model.name}" + (" (raw)" if target == "raw" else "")
            for ax, points in ((decode_ax, decode), (prefill_ax, prefill)):
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=f"C{i % 10}", label=label)
    decode_ax.set(title="Decode at depth", xlabel="context depth (tokens)",
                  ylabel="client decode tok/s")
    prefill_ax.set(title="Prefill", xlabel="prompt tokens", ylabel="prefill tok/s")
    for ax in (decode_ax, prefill_ax):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.savefig(path, format="png", dpi=100)


# -- rendering -------------------------------------------------------------------------------

def render_run(info: RunInfo, host: HostRecord | None, cells: Sequence[ResultCell],
               fmt: str = "md") -> str:
    """The run's report: md (conditions, then tables), json or csv."""
    all_rows = rows(cells)
    if fmt == "json":
        return json.dumps(_json(info, host, cells, all_rows), indent=2) + "\n"
    if fmt == "csv":
        return _csv(info.id, all_rows)
    if fmt != "md":
        raise ValueError(f"unknown format {fmt!r}: md, json or csv")
    return _markdown(info, host, cells, all_rows)


def _ab_compares(cells: Sequence[ResultCell]) -> list[tuple[str, str, list[CompareRow]]]:
    """Each later variant against the first, e.g. [("A", "B", rows)]."""
    labels = variants(cells)
    return [(labels[0], other, compare(of_variant(cells, labels[0]), of_variant(cells, other),
                                       labels[0], other)) for other in labels[1:]]


def _json(info: RunInfo, host: HostRecord | None, cells: Sequence[ResultCell],
          all_rows: list[Row]) -> dict[str, Any]:
    run = dataclasses.asdict(info) | {"status": str(info.status)}
    compares = [{"a": a, "b": b, "rows": [dataclasses.asdict(r) for r in found]}
                for a, b, found in _ab_compares(cells)]
    return {"run": run, "host": dataclasses.asdict(host) if host else None,
            "rows": [dataclasses.asdict(r) for r in all_rows], "compare": compares}


def _csv(run_id: int, all_rows: list[Row]) -> str:
    flat = [{"run": run_id, **_flatten(dataclasses.asdict(r))} for r in all_rows]
    header = list(dict.fromkeys(key for line in flat for key in line))
    out = io.StringIO()
    writer = csv.DictWriter(out, header, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return out.getvalue()


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """ttft_ms -> ttft_ms_min, ttft_ms_median, ...; the kind's extras keep their own names."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}_{key}" if prefix else key
        if isinstance(value, Mapping):
            out |= _flatten(value, "" if name == "extra" else name)
        elif isinstance(value, list):
            out[name] = " ".join(map(str, value))
        else:
            out[name] = value
    return out


def render_runs(infos: Sequence[RunInfo], counts: Mapping[int, int] | None = None) -> str:
    """The stored runs, one line each; `counts` is cells per run id (see `cell_counts`)."""
    counts = counts or {}
    body = [[str(i.id), i.kind, i.started_at, str(i.status), f"{i.model.name} {i.model.quant}",
             str(counts.get(i.id, "-")), i.note] for i in infos]
    return _lines(_table(["run", "kind", "started", "status", "model", "cells", "note"], body))


def cell_counts(store: Store) -> dict[int, int]:
    """Cells stored per run id, in one query."""
    sql = "select run_id, count(*) from results group by run_id"
    return {int(run_id): int(n) for run_id, n in store.db.execute(sql).fetchall()}


# -- markdown --------------------------------------------------------------------------------

RATE_COLUMNS = (("ttft ms", "ttft_ms", "{:,.0f}"),
                ("prefill tok/s", "prefill_tps", "{:,.1f}"),
                ("engine prefill tok/s", "engine_prefill_tps", "{:,.1f}"),
                ("client decode tok/s", "client_decode_tps", "{:,.1f}"),
                ("engine decode tok/s", "engine_decode_tps", "{:,.1f}"))


def render_compare(found: Sequence[CompareRow], label_a: str = "A", label_b: str = "B",
                   title: str | None = None) -> str:
    """The seed-003 style A/B table: A / B medians with the median pairwise change."""
    columns = [c for c in RATE_COLUMNS if c[1] in COMPARED]
    body = [[_escape(r.cell), r.target, r.mode,
             str(max(getattr(r, attr).pairs for _, attr, _ in columns)),
             *(_ratio_cell(getattr(r, attr), f) for _, attr, f in columns)] for r in found]
    return _lines([
        f"### {title or f'{label_b} against {label_a}'}", "",
        f"Each figure is {label_a} / {label_b}, the median of each side's cells; the change in "
        f"brackets is the median of the pairwise ratios {label_b}/{label_a} of cells measured "
        "side by side (rule 7), the figure to quote.", "",
        *_table(["cell", "target", "mode", "pairs", *(h for h, _, _ in columns)], body)])


def _markdown(info: RunInfo, host: HostRecord | None, cells: Sequence[ResultCell],
              all_rows: list[Row]) -> str:
    lines = _conditions(info, host) + _identity_banner(all_rows)
    if all_rows:
        lines += ["Each rate is min / median / max over a row's cells; gap is client over engine "
                  f"decode, marked ! past {GAP_FLAG:.0%}.", ""]
    else:
        lines += ["No cells stored.", ""]
    with_variant = any(r.variant for r in all_rows)
    kinds = [k for k in KIND_TITLES if any(r.kind == k for r in all_rows)]
    kinds += [k for k in dict.fromkeys(r.kind for r in all_rows) if k not in KIND_TITLES]
    for kind in kinds:
        lines += _rate_table(kind, [r for r in all_rows if r.kind == kind], with_variant)
    for a, b, found in _ab_compares(cells):
        lines += [render_compare(found, a, b, f"A/B: {b} against {a}"), ""]
    against_raw = served_against_raw(cells)
    if against_raw:
        lines += [render_compare(against_raw, "raw", "served", "Served against the raw llama.cpp reference"), ""]
    for summary in (_concurrency_table, _agent_table, _needle_table):
        lines += summary(all_rows, with_variant)
    lines += _agent_against_cold(cells)
    return _lines(lines)


def served_against_raw(cells: Sequence[ResultCell]) -> list[CompareRow]:
    """Pairwise served / raw ratios for every cell measured both ways (the serving overhead)."""
    raw = [c for c in cells if c.target == "raw"]
    labels = {_label(c) for c in raw}
    served = [c for c in cells if c.target == "served" and not c.variant and _label(c) in labels]
    if not raw or not served:
        return []
    same = "reference"  # one target name on both sides, so compare() pairs them by cell label
    return compare([dataclasses.replace(c, target=same) for c in raw],
                   [dataclasses.replace(c, target=same) for c in served], "raw", "served")


def agent_against_cold(cells: Sequence[ResultCell]) -> list[dict[str, Any]]:
    """Each cold request of an agent replay beside what the replay paid at that depth: the
    median TTFT of the follow-up turns of the same turn number, and of the turns after a
    restart when the cold request is at the last turn; ratios to cold (issue #6's figures)."""
    out = []
    for variant in variants(cells) or [""]:
        mine = [c for c in cells if c.variant == variant]
        colds = sorted((c for c in mine if c.kind == "agent-cold"), key=_turn)
        last_turn = max((_turn(c) for c in mine if c.kind == "agent"), default=None)
        for cold in colds:
            rows = [("follow-up", [c for c in mine if c.kind == "agent" and _turn(c) == _turn(cold)])]
            if _turn(cold) == last_turn:
                rows.append(("after restart", [c for c in mine if c.kind == "agent-restart"]))
            for what, found in rows:
                ttft = stat(c.ttft_ms for c in found).median
                if ttft is None:
                    continue
                out.append({"variant": variant, "turn": _turn(cold), "what": what, "cold_depth": cold.prompt_tokens,
                            "cold_ttft_ms": cold.ttft_ms, "ttft_ms": ttft, "n": len(found),
                            "cached_tokens": stat(c.cached_tokens for c in found).median,
                            "ratio": ttft / cold.ttft_ms if cold.ttft_ms else None})
    return out


def _agent_against_cold(cells: Sequence[ResultCell]) -> list[str]:
    found = agent_against_cold(cells)
    with_variant = any(r["variant"] for r in found)
    body = [[*([r["variant"]] * with_variant), str(r["turn"]), r["what"], f"{r['cold_depth']:,}",
             f"{r['cold_ttft_ms']:,.0f}", f"{r['ttft_ms']:,.0f} (n={r['n']})", f"{r['cached_tokens']:,.0f}",
             _times(r["ratio"])] for r in found]
    header = [*(["variant"] * with_variant), "turn", "request", "cold prompt tokens", "cold ttft ms",
              "replay ttft ms, median", "cached tokens, median", "replay / cold"]
    return _summary("Agent replay against a cold request at the same depth", header, body)


def _conditions(info: RunInfo, host: HostRecord | None) -> list[str]:
    m = info.model
    lines = [f"## Run {info.id}: {info.kind}, {info.status}", ""]
    if info.status != RunStatus.COMPLETE:
        lines += [f"> **INCOMPLETE: this run is {info.status}, not complete.** "
                  f"{info.note or 'Nothing recorded says what is missing.'}", ""]
    lines += [f"- model: {m.name}, {m.quant}, sha256 {m.sha256[:12]}, {m.size_bytes / GIB:.1f} GiB",
              f"- appliance {info.appliance_version}; started {info.started_at}, "
              f"finished {info.finished_at or 'never'}",
              f"- command: `{' '.join(info.command)}`",
              f"- engine: {_settings(info.engine_settings)}",
              *_host(host), *_peak_rss(host), ""]
    return lines + _phases(host)


def _peak_rss(host: HostRecord | None) -> list[str]:
    """Peak resident memory of the processes the run measured, when the bench could read it."""
    rss = (host.snapshot.get("peak_rss_bytes") if host else None) or {}
    if not rss:
        return []
    return ["- peak RSS at the end of the run: " + ", ".join(f"{name} {n / 2**20:,.0f} MiB"
                                                          for name, n in rss.items())]


def _settings(settings: Mapping[str, Any]) -> str:
    def compact(v: Any) -> str:
        return json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else str(v)
    return " ".join(f"{k}={compact(v)}" for k, v in sorted(settings.items())) or "none recorded"


def _fact(d: Any, key: str, show: Callable[[Any], str] = str) -> str:
    """A snapshot fact as hostcheck stores it: the value, or {"unavailable": reason}."""
    value = d.get(key) if isinstance(d, Mapping) else None
    if value is None:
        return "unavailable"
    if isinstance(value, Mapping) and "unavailable" in value:
        return f"unavailable ({value['unavailable']})"
    return show(value)


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def _watts(w: float) -> str:
    return f"{w:.0f} W"


def _host(host: HostRecord | None) -> list[str]:
    if host is None:
        return ["- host: unavailable (no snapshot stored with this run)"]
    s = host.snapshot
    cpu, mem, kernel, iommu = (s.get(k, {}) for k in ("cpu", "memory", "kernel", "iommu"))
    cmdline = _fact(kernel, "cmdline", lambda c: f"`{c}`")
    lines = [f"- host snapshot: {_fact(s, 'taken_at')}",
             f"- CPU: {_fact(cpu, 'model')}, {_fact(cpu, 'physical_cores')} cores / "
             f"{_fact(cpu, 'logical_cpus')} threads, governor {_fact(cpu, 'governor')}, "
             f"driver {_fact(cpu, 'scaling_driver')}, boost "
             f"{_fact(cpu, 'boost', lambda b: 'on' if b else 'off')}, max "
             f"{_fact(cpu, 'max_mhz', lambda v: f'{v:.0f} MHz')}"
             + (", virtual machine" if cpu.get("virtual_machine") else ""),
             f"- memory: {_fact(mem, 'total_bytes', _gib)}, transparent huge pages "
             f"{_fact(mem, 'thp_enabled')}",
             f"- kernel: {_fact(kernel, 'release')} on {_fact(kernel, 'distribution')}",
             f"- kernel command line: {cmdline}",
             f"- IOMMU: {_fact(iommu, 'mode')}"]
    return lines + _power(s.get("power", {})) + _gpus(s.get("gpu", {}))


def _power(power: Mapping[str, Any]) -> list[str]:
    lines = [f"- power {d.get('label', '?')} ({d.get('kind', '?')}): limit "
             f"{_fact(d, 'cap_w', _watts)}, default {_fact(d, 'default_cap_w', _watts)}, max "
             f"{_fact(d, 'max_cap_w', _watts)}" for d in power.get("domains", [])]
    why = "; ".join(power.get("not_found", [])) or "not in the snapshot"
    return lines or [f"- power limits: unavailable ({why})"]


def _gpus(gpu: Mapping[str, Any]) -> list[str]:
    lines = [f"- GPU: {g.get('vendor', '?')} {_fact(g, 'name')}, arch {_fact(g, 'arch')}, "
             f"{_fact(g, 'unified', lambda u: 'unified memory' if u else 'dedicated VRAM')}, "
             f"VRAM {_fact(g, 'vram_bytes', _gib)}, GTT {_fact(g, 'gtt_bytes', _gib)}, "
             f"driver {_fact(g, 'driver')}, runtime {_fact(g, 'runtime')}"
             for g in gpu.get("gpus", [])]
    why = "; ".join(gpu.get("not_found", [])) or "not in the snapshot"
    return lines or [f"- GPU: unavailable ({why})"]


def _phases(host: HostRecord | None) -> list[str]:
    if host is None or not host.phases:
        return ["Power and clocks per phase: unavailable (no sampler figures stored).", ""]

    def num(p: Mapping[str, Any], key: str, f: str) -> str:
        return "unavailable" if p.get(key) is None else f.format(p[key])
    body = [[name, num(p, "median_power_w", "{:,.1f}"), num(p, "median_cpu_mhz", "{:,.0f}"),
             num(p, "median_gpu_mhz", "{:,.0f}"), str(p.get("n_samples", 0))]
            for name, p in host.phases.items()]
    header = ["phase", "median power W", "median CPU MHz", "median GPU MHz", "samples"]
    return ["Power and clocks per phase:", "", *_table(header, body), ""]


def _identity_banner(all_rows: list[Row]) -> list[str]:
    bad = [f"{r.cell} ({_where(r)}, {n} {'cell' if n == 1 else 'cells'})"
           for r in all_rows if (n := r.extra["identity_failures"])]
    if not bad:
        return []
    return [f"> **IDENTITY CHECK FAILED (rule 12):** output differed from serial greedy decoding "
            f"in {'; '.join(bad)}.", ""]


def _where(r: Row) -> str:
    return f"{r.target}, variant {r.variant}" if r.variant else r.target


def _rate_table(kind: str, kind_rows: list[Row], with_variant: bool) -> list[str]:
    rates = [c for c in RATE_COLUMNS
             if c[1] != "engine_prefill_tps" or any(r.engine_prefill_tps.n for r in kind_rows)]
    header = ["cell", "target", *(["variant"] * with_variant), "mode", "prompt set", "cache",
              "streams", "prompt tokens", "depth", "generated", "runs",
              *(h for h, _, _ in rates), "gap"]
    body = [[_escape(r.cell) + _identity_mark(r), r.target, *([r.variant] * with_variant),
             r.mode, r.prompt_set, "on" if r.cache_on else "off", str(r.concurrency),
             f"{r.prompt_tokens:,}", f"{r.depth:,}", f"{r.generated_tokens:,}", str(r.runs),
             *(_stat(getattr(r, attr), f) for _, attr, f in rates), _gap(r)] for r in kind_rows]
    return [f"### {KIND_TITLES.get(kind, kind)}", "", *_table(header, body), ""]


def _concurrency_table(all_rows: list[Row], with_variant: bool) -> list[str]:
    found = [r for r in all_rows if r.kind == "concurrency"]
    body = [[_escape(r.cell), r.target, *([r.variant] * with_variant), str(r.concurrency),
             _stat(r.extra["aggregate_tps"], "{:,.1f}"), _times(r.extra["batching_gain"])]
            for r in found]
    header = ["cell", "target", *(["variant"] * with_variant), "streams", "aggregate tok/s",
              "batching gain"]
    return _summary("Concurrency: aggregate decode, and its gain over one stream", header, body)


def _agent_table(all_rows: list[Row], with_variant: bool) -> list[str]:
    found = [r for r in all_rows if r.kind == "agent"]
    body = [[_escape(r.cell), r.target, *([r.variant] * with_variant), str(r.runs),
             _stat(e["first_ttft_ms"], "{:,.0f}"), _num(e["followup_ttft_ms_median"], "{:,.0f}"),
             _num(e["followup_ttft_ms_p95"], "{:,.0f}"), _num(e["cached_share"], "{:.1%}"),
             _times(e["last_over_second"])] for r in found for e in [r.extra]]
    header = ["cell", "target", *(["variant"] * with_variant), "runs", "first turn ttft ms",
              "follow-up ttft ms, median", "follow-up ttft ms, p95", "follow-up tokens from cache",
              "last turn / second turn ttft"]
    return _summary("Agent replay: what a follow-up turn costs", header, body)


def _needle_table(all_rows: list[Row], with_variant: bool) -> list[str]:
    found = [r for r in all_rows if r.kind == "needle"]
    body = [[_escape(r.cell), r.target, *([r.variant] * with_variant), f"{r.prompt_tokens:,}",
             f"{e['found']}/{e['total']}", " ".join(map(str, e["status"])),
             " ".join(map(str, e["expected_status"])), "yes" if e["ok"] else "**NO**"]
            for r in found for e in [r.extra]]
    header = ["cell", "target", *(["variant"] * with_variant), "prompt tokens", "found",
              "HTTP status", "expected", "ok"]
    return _summary("Context length: the planted code found, and a clean 400 past the limit",
                    header, body)


def _summary(title: str, header: list[str], body: list[list[str]]) -> list[str]:
    return [f"### {title}", "", *_table(header, body), ""] if body else []


def _identity_mark(r: Row) -> str:
    n = r.extra["identity_failures"]
    return f" **(OUTPUT DIFFERS FROM SERIAL: {n})**" if n else ""


def _stat(s: Stat, f: str) -> str:
    if s.n == 0:
        return "-"
    if s.n == 1:
        return f.format(s.median)
    return " / ".join(f.format(v) for v in (s.min, s.median, s.max))


def _num(v: float | None, f: str) -> str:
    return "-" if v is None else f.format(v)


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _gap(r: Row) -> str:
    gap = r.extra["decode_gap"]
    return "-" if gap is None else f"{gap:+.1%}" + (" !" if r.extra["flag_gap"] else "")


def _ratio_cell(r: Ratio, f: str) -> str:
    text = f"{_num(r.a, f)} / {_num(r.b, f)}"
    return text if r.ratio is None else f"{text} ({r.ratio - 1:+.1%})"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(line) + " |" for line in body)]


def _lines(lines: Iterable[str]) -> str:
    return "\n".join(lines).rstrip("\n") + "\n"
