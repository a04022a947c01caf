"""The reports `appliance bench`, `sweep` and `results` print: a run as markdown (its
conditions first: model, command, engine settings, host, peak RSS, power and clocks per phase;
then one table per kind of cell, the A/B and served-against-raw ratios, and the concurrency,
agent and needle summaries), JSON or CSV; the list of runs; a comparison table. The figures
come from `results` (pure functions of stored cells); this module only lays them out.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..store import HostRecord, ResultCell, RunInfo, RunStatus, Store
from . import soakreport
from .energy_report import energy_lines
from .report_host import host_lines
from .results import (COMPARED, GIB, KIND_TITLES, CompareRow, Ratio, agent_against_cold, compare, modes_against_serial,
                      of_variant, served_against_raw, variants)
from .rows import GAP_FLAG, Row, Stat, rows

# -- a run -------------------------------------------------------------------------------

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
                ("engine decode tok/s", "engine_decode_tps", "{:,.1f}"),
                ("prefill tok/J", "prefill_tpj", "{:,.2f}"),
                ("decode tok/J", "decode_tpj", "{:,.3f}"))
ENERGY_COLUMNS = ("prefill_tpj", "decode_tpj")


def render_compare(found: Sequence[CompareRow], label_a: str = "A", label_b: str = "B",
                   title: str | None = None) -> str:
    """The seed-003 style A/B table: A / B medians with the median pairwise change."""
    columns = [c for c in RATE_COLUMNS if c[1] in COMPARED
               and (c[1] not in ENERGY_COLUMNS or any(getattr(r, c[1]).pairs for r in found))]
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
    if info.kind == "soak":     # its cells are requests, not rates: soakreport lays them out
        found = soakreport.from_stored(host, cells)
        return _lines(_conditions(info, host) + (soakreport.render(found) if found else ["No soak figures stored."]))
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
    lines += _modes_against_serial(cells)
    for summary in (_concurrency_table, _agent_table, _needle_table):
        lines += summary(all_rows, with_variant)
    lines += _agent_against_cold(cells)
    if all_rows:
        lines += energy_lines(host.phases if host else {}, cells, _table)
    return _lines(lines)


def _modes_against_serial(cells: Sequence[ResultCell]) -> list[str]:
    lines = []
    for mode, found, record in modes_against_serial(cells):
        body = []
        for r in found:
            rec = record.get(r.cell, {})
            drafted, accepted = rec.get("draft_n", 0), rec.get("draft_n_accepted", 0)
            body.append([_escape(r.cell), str(r.client_decode_tps.pairs),
                         _ratio_cell(r.client_decode_tps, "{:,.1f}"), _ratio_cell(r.engine_decode_tps, "{:,.1f}"),
                         _num(rec.get("tokens_per_step"), "{:,.2f}"), f"{accepted:,} / {drafted:,}",
                         f"{accepted / drafted:.0%}" if drafted else "-"])
        header = ["cell", "pairs", "client decode tok/s", "engine decode tok/s", "tokens per step",
                  "accepted / drafted", "acceptance"]
        lines += _summary(f"Speculation: {mode} against serial (serial / {mode}, with the median "
                          "pairwise change)", header, body)
    return lines


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
              *host_lines(host.snapshot if host else None), *_peak_rss(host), ""]
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


def _phases(host: HostRecord | None) -> list[str]:
    if host is None or not host.phases:
        return ["Power and clocks per phase: unavailable (no sampler figures stored).", ""]

    def num(p: Mapping[str, Any], key: str, f: str) -> str:
        return "unavailable" if p.get(key) is None else f.format(p[key])
    body = [[name, num(p, "median_power_w", "{:,.1f}"), num(p, "median_cpu_mhz", "{:,.0f}"),
             num(p, "median_gpu_mhz", "{:,.0f}"), str(p.get("n_samples", 0)), _joules(p),
             num(p, "seconds", "{:,.1f}")] for name, p in host.phases.items()]
    header = ["phase", "median power W", "median CPU MHz", "median GPU MHz", "samples", "energy J", "seconds"]
    return ["Power and clocks per phase:", "", *_table(header, body), ""]


def _joules(p: Mapping[str, Any]) -> str:
    """A phase's joules; a run stored before energy was measured has neither joules nor a note."""
    if p.get("joules") is not None:
        by = p.get("joules_by_reader") or {}
        parts = ", ".join(f"{r} {j:,.1f}" for r, j in by.items() if j is not None)
        return f"{p['joules']:,.1f}" + (f" ({parts})" if len(by) > 1 else "")
    return f"unavailable ({p['energy_note']})" if p.get("energy_note") else "unavailable (not measured)"


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
    rates = [c for c in RATE_COLUMNS if c[1] not in ("engine_prefill_tps", *ENERGY_COLUMNS)
             or any(getattr(r, c[1]).n for r in kind_rows)]
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
