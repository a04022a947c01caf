"""What a run's energy says, laid out for its report: the idle power measured before the first
cell, each row's joules per request and tokens per joule gross and above idle, and with
`--power-cap` the envelope with the best tokens per joule beside the one with the best tokens
per second, and what each costs in the other. Pure functions of stored cells and phases.

Gross is what the readers measured; above idle subtracts the idle power times the span's
seconds, which is what the work itself cost. Where nothing was measured every figure is
`unavailable (reason)`, with the reason the measuring side stored.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..store import ResultCell
from .energy import IDLE_PHASE, above_idle, idle_watts
from .rows import cell_label, groups, stat


@dataclass(frozen=True)
class Envelope:
    cap_w: float
    prefill_tps: float | None     # medians over the served cells measured under this cap
    decode_tps: float | None
    prefill_tpj: float | None
    decode_tpj: float | None


def energy_lines(phases: Mapping[str, Any], cells: Sequence[ResultCell],
                 table: Callable[[Sequence[str], list[list[str]]], list[str]]) -> list[str]:
    if not cells:
        return []
    idle_w = idle_watts(phases)
    if not any(c.request_j is not None for c in cells):
        return [f"Energy per cell: unavailable ({why_none(cells) or _phase_note(phases) or 'no reason stored'}).", ""]
    body = [_row(group, idle_w) for group in groups(cells) if any(c.request_j is not None for c in group)]
    header = ["cell", "target", "variant", "J / request", "J / request above idle", "prefill tok/J",
              "prefill tok/J above idle", "decode tok/J", "decode tok/J above idle"]
    return [f"### Energy: gross, and above the idle power ({_idle(phases, idle_w)})", "",
            "Joules integrated over each request's prefill and decode spans; tokens per joule is the "
            "rate over the span's mean power. Medians over the row's cells.", "",
            *table(header, body), "", *envelope_lines(cells, table)]


def why_none(cells: Sequence[ResultCell]) -> str:
    """The reason most cells give for having no joules ("" when none gives one)."""
    found = Counter(c.energy_note for c in cells if c.request_j is None and c.energy_note)
    return found.most_common(1)[0][0] if found else ""


def _phase_note(phases: Mapping[str, Any]) -> str:
    return next((p.get("energy_note", "") for p in phases.values() if p.get("energy_note")), "")


def _idle(phases: Mapping[str, Any], idle_w: float | None) -> str:
    if idle_w is not None:
        return f"idle {idle_w:,.1f} W over {phases[IDLE_PHASE]['seconds']:.1f} s before the first cell"
    why = (phases.get(IDLE_PHASE) or {}).get("energy_note") or "not measured (--idle-seconds 0)"
    return f"idle power unavailable ({why})"


def _row(group: list[ResultCell], idle_w: float | None) -> list[str]:
    first = group[0]

    def med(values: Sequence[float | None], f: str) -> str:
        m = stat(values).median
        return "-" if m is None else f.format(m)
    return [cell_label(first), first.target, first.variant or "-",
            med([c.request_j for c in group], "{:,.2f}"),
            med([above_idle(c.request_j, c.request_s, idle_w) for c in group], "{:,.2f}"),
            med([c.prefill_tpj for c in group], "{:,.2f}"),
            med([_tpj(c.prefill_tps, c.prefill_j, c.prefill_s, idle_w) for c in group], "{:,.2f}"),
            med([c.decode_tpj for c in group], "{:,.3f}"),
            med([_tpj(c.client_decode_tps, c.decode_j, c.decode_s, idle_w) for c in group], "{:,.3f}")]


def _tpj(rate: float | None, joules: float | None, seconds: float | None, idle_w: float | None) -> float | None:
    net = above_idle(joules, seconds, idle_w)
    if rate is None or net is None or seconds is None or net <= 0:
        return None
    return rate * seconds / net


# -- power envelopes -------------------------------------------------------------------------

def envelopes(cells: Sequence[ResultCell]) -> list[Envelope]:
    """Per power cap, the medians over its served cells, in order of the caps."""
    out = []
    for cap in sorted({c.power_cap_w for c in cells if c.power_cap_w is not None}):
        mine = [c for c in cells if c.power_cap_w == cap and c.target == "served"]
        out.append(Envelope(cap, stat(c.prefill_tps for c in mine).median,
                            stat(c.client_decode_tps for c in mine).median,
                            stat(c.prefill_tpj for c in mine).median,
                            stat(c.decode_tpj for c in mine).median))
    return out


def envelope_verdict(found: Sequence[Envelope]) -> list[str]:
    """The envelope with the best decode tokens per joule and the one with the best decode
    tokens per second, each with what it costs in the other figure."""
    speed = [e for e in found if e.decode_tps is not None]
    thrift = [e for e in found if e.decode_tpj is not None]
    if len(found) < 2 or not speed:
        return []
    fast = max(speed, key=lambda e: e.decode_tps or 0.0)
    lines = [f"- fastest decode: {_w(fast.cap_w)}, {fast.decode_tps:,.1f} tok/s"
             + (f", {fast.decode_tpj:,.3f} tok/J" if fast.decode_tpj is not None else "")]
    if not thrift:
        return lines + ["- best tokens per joule: unavailable (no energy measured under any cap)"]
    lean = max(thrift, key=lambda e: e.decode_tpj or 0.0)
    lines.append(f"- best decode tokens per joule: {_w(lean.cap_w)}, {lean.decode_tpj:,.3f} tok/J, "
                 f"{_num(lean.decode_tps, '{:,.1f}')} tok/s")
    if lean is not fast and lean.decode_tps and fast.decode_tpj:
        lines.append(f"- {_w(lean.cap_w)} against {_w(fast.cap_w)}: {lean.decode_tps / fast.decode_tps - 1:+.1%} "
                     f"tok/s for {lean.decode_tpj / fast.decode_tpj - 1:+.1%} tok/J")
    elif lean is fast:
        lines.append(f"- {_w(fast.cap_w)} is both: no trade between speed and energy in these caps")
    return lines


def envelope_lines(cells: Sequence[ResultCell],
                   table: Callable[[Sequence[str], list[list[str]]], list[str]]) -> list[str]:
    found = envelopes(cells)
    if not found:
        return []
    body = [[_w(e.cap_w), _num(e.prefill_tps, "{:,.1f}"), _num(e.prefill_tpj, "{:,.2f}"),
             _num(e.decode_tps, "{:,.1f}"), _num(e.decode_tpj, "{:,.3f}")] for e in found]
    header = ["cap", "prefill tok/s", "prefill tok/J", "decode tok/s", "decode tok/J"]
    return ["### Power envelopes: served cells under each cap, medians", "", *table(header, body), "",
            *envelope_verdict(found), ""]


def _w(cap: float) -> str:
    return f"{cap:g} W"


def _num(v: float | None, f: str) -> str:
    return "-" if v is None else f.format(v)
