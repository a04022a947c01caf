"""The figures behind what `appliance bench`, `sweep` and `results` print, from the rows of
stored cells (rows.py): A/B, run-against-run and served-against-raw comparisons by pairwise
ratios; the agent replay against cold requests; job-time estimates from the stored prefill and
decode curves; and a plot of those curves (`report.py` lays them out as markdown, JSON or CSV).
Rules cited are shared/BENCHMARKING.md's.

Everything here is a pure function of stored data (RunInfo, HostRecord, ResultCell lists).
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..store import ResultCell, RunInfo, Store
from .rows import cell_label, groups, joined, rows, stat, turn_of

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
TPJ = ("prefill_tpj", "decode_tpj")   # the tokens-per-joule curves' metrics
COMPARED = ("ttft_ms", "prefill_tps", "client_decode_tps", "engine_decode_tps", "prefill_tpj", "decode_tpj")


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
    prefill_tpj: Ratio       # tokens per joule (gross)
    decode_tpj: Ratio


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
                              mode=joined(c.mode for c in group_a + group_b), **ratios))
    return out


def variants(cells: Iterable[ResultCell]) -> list[str]:
    """The run's A/B labels in order of first appearance (empty for a run without variants)."""
    return [v for v in dict.fromkeys(c.variant for c in cells) if v]


def of_variant(cells: Iterable[ResultCell], variant: str) -> list[ResultCell]:
    return [c for c in cells if c.variant == variant]


def _keyed(cells: Sequence[ResultCell], label: str) -> dict[tuple[str, str, str], list[ResultCell]]:
    out: dict[tuple[str, str, str], list[ResultCell]] = {}
    for group in groups(cells):
        key = (cell_label(group[0]), group[0].target, group[0].mode)
        if key in out:
            raise ValueError(f"side {label} holds {key[0]!r} ({key[1]}) in several variants; "
                             "compare one variant at a time")
        out[key] = group
    return out


def _pair_key(c: ResultCell) -> tuple[int, int, int, int]:
    e = c.extra
    return (c.repeat_index, int(e.get("stream", 0)), int(e.get("conversation", 0)), turn_of(c))


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
    prefill_j: float | None = None            # gross joules from the tokens-per-joule curves
    decode_j: float | None = None
    energy_note: str = ""                     # why they are None


Curve = list[tuple[int, float]]


def curves(cells: Sequence[ResultCell], target: str = "served",
           metrics: tuple[str, str] = ("prefill_tps", "client_decode_tps")) -> tuple[Curve, Curve]:
    """(prompt tokens, median prefill tok/s) and (depth, median client decode tok/s), sorted, one
    point per row, from the target's serial, cache-off, one-stream sweep/prompt/depth rows of
    variant "" or "A" (the baseline of an A/B run). `metrics` ("prefill_tpj", "decode_tpj")
    gives the tokens-per-joule curves instead."""
    usable = [r for r in rows(cells)
              if r.target == target and r.variant in ("", "A") and r.kind in CURVE_KINDS
              and r.mode == "serial" and not r.cache_on and r.concurrency == 1]
    prefill = [(r.prompt_tokens, m) for r in usable if (m := getattr(r, metrics[0]).median) and m > 0]
    decode = [(r.depth, m) for r in usable if (m := getattr(r, metrics[1]).median) and m > 0]
    return sorted(prefill), sorted(decode)


def _energy(cells: Sequence[ResultCell], prompt_tokens: int, positions: np.ndarray,
            output_tokens: int) -> dict[str, Any]:
    """Joules for the job from the tokens-per-joule curves, as time is from the rate curves."""
    prefill, decode = curves(cells, metrics=TPJ)
    if not prefill or not decode:
        why = next((c.energy_note for c in cells if c.energy_note), "") or "no tokens-per-joule curves"
        return {"energy_note": why}
    px, py = _merged(prefill)
    dx, dy = _merged(decode)
    decode_j = float(np.sum(1.0 / np.interp(positions, dx, dy))) if output_tokens else 0.0
    return {"prefill_j": prompt_tokens / float(np.interp(prompt_tokens, px, py)), "decode_j": decode_j}


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
                    run_id, (int(px[0]), int(px[-1])), (int(dx[0]), int(dx[-1])),
                    **_energy(cells, prompt_tokens, positions, output_tokens))


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
    if e.prefill_j is not None and e.decode_j is not None:
        text += (f"\nenergy: prefill {e.prefill_j:,.1f} J, decode {e.decode_j:,.1f} J, total "
                 f"{e.prefill_j + e.decode_j:,.1f} J (gross, from the same run's tokens per joule)")
    else:
        text += f"\nenergy: unavailable ({e.energy_note})"
    if e.extrapolated:
        text += (f"\nwarning: outside the measured curves (prefill {e.prefill_range[0]:,}.."
                 f"{e.prefill_range[1]:,} tokens, decode at depth {e.decode_range[0]:,}.."
                 f"{e.decode_range[1]:,}); the nearest measured rate was held, so this is a guess")
    return text


def _secs(s: float) -> str:
    return f"{s:,.1f} s" if s >= 1 else f"{s:.2f} s"


# -- plot ------------------------------------------------------------------------------------

def plot(runs: Sequence[tuple[RunInfo, Sequence[ResultCell]]], path: Any) -> list[str]:
    """Decode tok/s against depth and prefill tok/s against prompt tokens, one line per run and
    target (raw dashed), written as a PNG; where any run measured energy, decode and prefill
    tokens per joule below them (gross). Returns the panels' titles."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'appliance[plot]'") from e
    panels = [(("prefill_tps", "client_decode_tps"), "Decode at depth", "client decode tok/s",
               "Prefill", "prefill tok/s")]
    if any(any(curves(cells, t, TPJ)) for _, cells in runs for t in ("served", "raw")):
        panels.append((TPJ, "Decode energy at depth", "decode tok/J", "Prefill energy", "prefill tok/J"))
    fig = Figure(figsize=(12, 4.5 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)    # Agg, without pyplot's global state
    axes = fig.subplots(len(panels), 2, squeeze=False)
    for (metrics, d_title, d_unit, p_title, p_unit), (decode_ax, prefill_ax) in zip(panels, axes):
        for i, (info, cells) in enumerate(runs):
            for target, style in (("served", "-"), ("raw", "--")):
                prefill, decode = curves(cells, target, metrics)
                label = f"run {info.id} {info.model.name}" + (" (raw)" if target == "raw" else "")
                for ax, points in ((decode_ax, decode), (prefill_ax, prefill)):
                    if points:
                        ax.plot(*zip(*points), style, marker="o", color=f"C{i % 10}", label=label)
        decode_ax.set(title=d_title, xlabel="context depth (tokens)", ylabel=d_unit)
        prefill_ax.set(title=p_title, xlabel="prompt tokens", ylabel=p_unit)
        for ax in (decode_ax, prefill_ax):
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize="small")
    fig.savefig(path, format="png", dpi=100)
    return [ax.get_title() for row in axes for ax in row]


# -- derived tables ---------------------------------------------------------------------------

def served_against_raw(cells: Sequence[ResultCell]) -> list[CompareRow]:
    """Pairwise served / raw ratios for every cell measured both ways (the serving overhead)."""
    raw = [c for c in cells if c.target == "raw"]
    labels = {cell_label(c) for c in raw}
    served = [c for c in cells if c.target == "served" and not c.variant and cell_label(c) in labels]
    if not raw or not served:
        return []
    same = "reference"  # one target name on both sides, so compare() pairs them by cell label
    return compare([dataclasses.replace(c, target=same) for c in raw],
                   [dataclasses.replace(c, target=same) for c in served], "raw", "served")


def modes_against_serial(cells: Sequence[ResultCell]) -> list[tuple[str, list[CompareRow], dict[str, dict]]]:
    """For each speculative mode of a bench run: pairwise mode / serial ratios per prompt cell
    (one variant at a time), and per cell the drafting record: tokens per step (median),
    drafted and accepted tokens (sums)."""
    out = []
    for variant in variants(cells) or [""]:
        mine = [c for c in cells if c.variant == variant and c.kind == "prompt"]
        serial = [dataclasses.replace(c, mode="-") for c in mine if c.mode == "serial"]
        for mode in dict.fromkeys(c.mode for c in mine if c.mode != "serial"):
            other = [c for c in mine if c.mode == mode]
            found = compare(serial, [dataclasses.replace(c, mode="-") for c in other], "serial", mode)
            record: dict[str, dict] = {}
            for c in other:
                r = record.setdefault(cell_label(c), {"steps": [], "draft_n": 0, "draft_n_accepted": 0})
                r["steps"].append(c.tokens_per_step)
                r["draft_n"] += int(c.extra.get("draft_n", 0))
                r["draft_n_accepted"] += int(c.extra.get("draft_n_accepted", 0))
            for r in record.values():
                r["tokens_per_step"] = stat(r.pop("steps")).median
            out.append((f"{mode}{f' ({variant})' if variant else ''}", found, record))
    return out


def agent_against_cold(cells: Sequence[ResultCell]) -> list[dict[str, Any]]:
    """Each cold request of an agent replay beside what the replay paid at that depth: the
    median TTFT of the follow-up turns of the same turn number, and of the turns after a
    restart when the cold request is at the last turn; ratios to cold (issue #6's figures)."""
    out = []
    for variant in variants(cells) or [""]:
        mine = [c for c in cells if c.variant == variant]
        colds = sorted((c for c in mine if c.kind == "agent-cold"), key=turn_of)
        last_turn = max((turn_of(c) for c in mine if c.kind == "agent"), default=None)
        for cold in colds:
            rows = [("follow-up", [c for c in mine if c.kind == "agent" and turn_of(c) == turn_of(cold)])]
            if turn_of(cold) == last_turn:
                rows.append(("after restart", [c for c in mine if c.kind == "agent-restart"]))
            for what, found in rows:
                ttft = stat(c.ttft_ms for c in found).median
                if ttft is None:
                    continue
                out.append({"variant": variant, "turn": turn_of(cold), "what": what, "cold_depth": cold.prompt_tokens,
                            "cold_ttft_ms": cold.ttft_ms, "ttft_ms": ttft, "n": len(found),
                            "cached_tokens": stat(c.cached_tokens for c in found).median,
                            "ratio": ttft / cold.ttft_ms if cold.ttft_ms else None})
    return out
