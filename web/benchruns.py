"""/api/bench: the result store's runs, read-only, for the benchmarks page.

Each request opens its own read-only connection to the file `appliance bench` and `sweep` write
(config.store.resolved_db_path(), env APPLIANCE_DB_PATH); a missing file is an empty list and is
never created. The figures are those of `appliance results` (appliance.bench.results, and the
report's JSON for a run's rows), so the page and the CLI agree to the digit.

    GET  /api/bench/runs             {"runs": [summary, ...]} newest first
    GET  /api/bench/runs/<id>        {"run", "conditions", "kinds" (titles), "rows", "ab",
                                      "served_against_raw", "series", "cells", "energy"}
    GET  /api/bench/compare?a=&b=    {"a", "b", "rows": [ratios B/A], "series": {"a", "b"}}
    POST /api/bench/estimate         {"prompt_tokens", "output_tokens", "run_id"?} -> the estimate
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlite_utils
from flask import Blueprint, current_app, jsonify, request

from appliance.bench import report, results
from appliance.bench.energy import idle_watts
from appliance.bench.energy_report import envelope_verdict, envelopes, why_none
from appliance.errors import ApplianceError, InvalidRequest, NotFound
from appliance.store import BUSY_TIMEOUT_MS, MIGRATIONS, HostRecord, ResultCell, RunInfo, Store, UnknownRun

from .params import Param
from .wire import parse_json_body

bp = Blueprint("benchruns", __name__)

MAX_PROMPT_TOKENS = 10_000_000
MAX_OUTPUT_TOKENS = 1_000_000      # the estimate sums over every output position
ESTIMATE = (Param("prompt_tokens", "integer", "Prompt tokens of the job", lo=0, hi=MAX_PROMPT_TOKENS),
            Param("output_tokens", "integer", "Tokens the job generates", lo=0, hi=MAX_OUTPUT_TOKENS),
            Param("run_id", "integer", "The run whose curves to use (default: the newest with both)",
                  lo=1, hi=2**63 - 1))
CHARTS = {  # series name -> axis labels, each with its unit
    "decode": ("context depth (tokens)", "client decode (tok/s)"),
    "prefill": ("prompt size (tokens)", "prefill (tok/s)"),
    "served_vs_raw": ("prompt size (tokens)", "served / raw (x)"),
}


class StoreOutdated(ApplianceError):
    """The file predates a migration; the page reads, so it leaves the upgrade to the CLI."""

    status, type, code = 409, "invalid_request_error", "store_outdated"


# -- the store, read-only ----------------------------------------------------------------------

@contextlib.contextmanager
def _store() -> Iterator[Store | None]:
    """A read-only Store over the server's result DB, or None while there is none."""
    path = Path(current_app.extensions["appliance"].config.store.resolved_db_path())
    if not path.is_file():
        yield None
        return
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        db = sqlite_utils.Database(conn, execute_plugins=False)
        if not db.table("runs").exists():      # created by a writer, not yet set up
            yield None
            return
        if MIGRATIONS.pending(db):
            raise StoreOutdated(f"{path} was written by an older appliance: run `appliance results` "
                                "once to bring it up to date")
        yield Store(db, path)
    finally:
        conn.close()


def _require(store: Store | None) -> Store:
    if store is None:
        raise NotFound("no runs stored yet: run `appliance sweep` or `appliance bench` first")
    return store


def _info(store: Store, run_id: int) -> RunInfo:
    try:
        return store.run(run_id)
    except UnknownRun as e:
        raise NotFound(str(e), param="run_id") from None


def _load(store: Store, run_id: int) -> tuple[RunInfo, HostRecord | None, list[ResultCell]]:
    return _info(store, run_id), store.host(run_id), store.results(run_id)


# -- summaries ---------------------------------------------------------------------------------

def _fact(d: Any, key: str) -> Any:
    """A snapshot fact as hostcheck stores it: the value, or None where it was unavailable."""
    value = d.get(key) if isinstance(d, Mapping) else None
    return None if isinstance(value, Mapping) and "unavailable" in value else value


def _host(host: HostRecord | None) -> dict[str, Any] | None:
    """What the runs table and the conditions say about the host; None without a snapshot."""
    if host is None:
        return None
    s = host.snapshot
    cpu, mem, kernel = (s.get(k, {}) for k in ("cpu", "memory", "kernel"))
    gpus = [" ".join(str(x) for x in (g.get("vendor"), _fact(g, "name")) if x) or "?"
            for g in s.get("gpu", {}).get("gpus", [])]
    power = [{"label": d.get("label"), "kind": d.get("kind"), "cap_w": _fact(d, "cap_w")}
             for d in s.get("power", {}).get("domains", [])]
    why = {k: "; ".join(s.get(k, {}).get("not_found", [])) or None for k in ("gpu", "power")}
    return {"taken_at": s.get("taken_at"), "cpu": _fact(cpu, "model"), "cores": _fact(cpu, "physical_cores"),
            "threads": _fact(cpu, "logical_cpus"), "governor": _fact(cpu, "governor"),
            "max_mhz": _fact(cpu, "max_mhz"), "virtual_machine": bool(cpu.get("virtual_machine")),
            "gpu": gpus, "memory_bytes": _fact(mem, "total_bytes"), "thp": _fact(mem, "thp_enabled"),
            "kernel": _fact(kernel, "release"), "distribution": _fact(kernel, "distribution"),
            "cmdline": _fact(kernel, "cmdline"), "iommu": _fact(s.get("iommu", {}), "mode"),
            "power": power, "unavailable": why, "peak_rss_bytes": s.get("peak_rss_bytes") or {}}


def _summary(info: RunInfo, host: HostRecord | None, cells: int) -> dict[str, Any]:
    m = info.model
    return {"id": info.id, "kind": info.kind, "command": list(info.command),
            "model": {"name": m.name, "quant": m.quant, "size_bytes": m.size_bytes, "sha256": m.sha256},
            "appliance_version": info.appliance_version, "started_at": info.started_at,
            "finished_at": info.finished_at, "status": str(info.status), "note": info.note,
            "engine": info.engine_settings, "host": _host(host), "cells": cells}


# -- series ------------------------------------------------------------------------------------

def _points(curve: results.Curve) -> list[list[float]]:
    """[[x, y], ...], one point per x (rows of one size merged as the estimate merges them)."""
    if not curve:
        return []
    xs, ys = results._merged(curve)
    return [[x, y] for x, y in zip(xs.tolist(), ys.tolist())]


def _served_vs_raw(cells: Sequence[ResultCell]) -> list[dict[str, Any]]:
    """served / raw, the median of pairwise ratios (rule 7), against the cells' prompt size."""
    sizes = {r.cell: r.prompt_tokens for r in results.rows(cells) if r.target == "raw"}
    found = [r for r in results.served_against_raw(cells)
             if r.kind in results.CURVE_KINDS and r.mode == "serial"]
    lines = []
    for label, metric in (("prefill", "prefill_tps"), ("client decode", "client_decode_tps")):
        curve = [(sizes[r.cell], ratio) for r in found if (ratio := getattr(r, metric).ratio) is not None]
        if curve:
            lines.append({"label": label, "points": _points(curve)})
    return lines


def _series(cells: Sequence[ResultCell]) -> dict[str, Any]:
    """Each chart's lines: decode against depth and prefill against prompt size (served and, where
    measured, raw: serial, cache-off, one stream, as `results.curves` picks them) and served / raw."""
    lines: dict[str, list[dict[str, Any]]] = {"decode": [], "prefill": [], "served_vs_raw": _served_vs_raw(cells)}
    for target in ("served", "raw"):
        prefill, decode = results.curves(cells, target)
        for name, curve in (("prefill", prefill), ("decode", decode)):
            if curve:
                lines[name].append({"label": target, "points": _points(curve)})
    return {name: {"x": CHARTS[name][0], "y": CHARTS[name][1], "lines": found}
            for name, found in lines.items()}


def _energy(host: HostRecord | None, cells: Sequence[ResultCell]) -> dict[str, Any]:
    """The idle power, why no cell has joules (None when some have), and the power envelopes
    with the report's verdict (energy_report.py)."""
    measured = any(c.request_j is not None for c in cells)
    why = None if measured else (why_none(cells) or "no reason stored")
    found = envelopes(cells)
    return {"idle_w": idle_watts(host.phases if host else {}), "unavailable": why,
            "envelopes": _asdicts(found), "verdict": envelope_verdict(found)}


# -- endpoints ---------------------------------------------------------------------------------

@bp.get("/api/bench/runs")
def list_runs():
    with _store() as store:
        if store is None:
            return jsonify({"runs": []})
        counts = report.cell_counts(store)
        found = [_summary(info, store.host(info.id), counts.get(info.id, 0)) for info in reversed(store.runs())]
    return jsonify({"runs": found})


@bp.get("/api/bench/runs/<int:run_id>")
def show_run(run_id: int):
    with _store() as store:
        info, host, cells = _load(_require(store), run_id)
    doc = json.loads(report.render_run(info, host, cells, "json"))    # the rows `results --format json` prints
    present = {row["kind"] for row in doc["rows"]}
    kinds = {k: results.KIND_TITLES.get(k, k) for k in [*results.KIND_TITLES, *sorted(present)] if k in present}
    conditions = {"engine": info.engine_settings, "host": _host(host),
                  "phases": host.phases if host else {}, "snapshot": host.snapshot if host else None}
    return jsonify({"run": _summary(info, host, len(cells)), "conditions": conditions, "kinds": kinds,
                    "rows": doc["rows"], "ab": doc["compare"], "served_against_raw": _asdicts(results.served_against_raw(cells)),
                    "series": _series(cells), "cells": _asdicts(cells), "energy": _energy(host, cells)})


@bp.get("/api/bench/compare")
def compare_runs():
    a, b = _run_arg("a"), _run_arg("b")
    with _store() as store:
        store = _require(store)
        (info_a, host_a, cells_a), (info_b, host_b, cells_b) = _load(store, a), _load(store, b)
    try:
        found = results.compare(cells_a, cells_b, f"run {a}", f"run {b}")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return jsonify({"a": _summary(info_a, host_a, len(cells_a)), "b": _summary(info_b, host_b, len(cells_b)),
                    "rows": _asdicts(found), "series": {"a": _series(cells_a), "b": _series(cells_b)}})


@bp.post("/api/bench/estimate")
def estimate():
    body = parse_json_body(request.get_data(cache=False))
    known = {p.name for p in ESTIMATE}
    if unknown := sorted(set(body) - known):
        raise InvalidRequest(f"unknown field {unknown[0]!r}: the estimate takes {', '.join(sorted(known))}",
                             param=unknown[0])
    prompt, output, run_id = (p.read(body) for p in ESTIMATE)
    for name, value in (("prompt_tokens", prompt), ("output_tokens", output)):
        if value is None:
            raise InvalidRequest(f"'{name}' is required", param=name)
    with _store() as store:
        if run_id is not None:
            _info(_require(store), run_id)
        try:
            found = results.estimate_from_store(_require(store), prompt, output, run_id)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
    return jsonify(dataclasses.asdict(found) | {"text": results.render_estimate(found)})


def _run_arg(name: str) -> int:
    value = request.args.get(name, "")
    if not (value.isascii() and value.isdigit() and 0 < int(value) < 2**63):
        raise InvalidRequest(f"'{name}' must be a run id (a positive integer), got {value!r}", param=name)
    return int(value)


def _asdicts(items: Sequence[Any]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(x) for x in items]
