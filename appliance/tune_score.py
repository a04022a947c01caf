"""How `appliance tune` chooses llama.cpp's settings from what it measured: the score of a
candidate at a depth (the time of one prompt chunk at its prefill rate plus DECODE_TOKENS at its
decode rate, plus the half block a follow-up recomputes where the prompt cache reuses whole grid
blocks only), the winner (a candidate within NEAR_TIE of the best loses to an earlier one), the
range of depths each plan entry covers, and the table that shows the choice. Pure functions of
the measurements; tune.py measures."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .compute_settings import LlamaCppSettings

NEAR_TIE = 0.02
CHUNK_TOKENS = 512      # the score: one prompt chunk...
DECODE_TOKENS = 128     # ...and this many generated tokens, at the depth...
REGRID_TOKENS = CHUNK_TOKENS // 2   # ...and, under grid reuse, what a follow-up recomputes on average


@dataclass(frozen=True)
class Measurement:
    candidate: int
    depth: int
    prefill_tps: float
    decode_tps: float
    grid_reuse: bool = False    # the prompt cache reuses whole grid blocks only on this candidate

    @property
    def score_s(self) -> float:
        regrid = REGRID_TOKENS / self.prefill_tps if self.grid_reuse else 0.0
        return CHUNK_TOKENS / self.prefill_tps + DECODE_TOKENS / self.decode_tps + regrid


def choose(cands: Sequence[LlamaCppSettings], measured: Sequence[Measurement], depth: int) -> tuple[int, dict]:
    """The winning candidate's index at this depth and the medians it was chosen on."""
    medians = {i: m for i in range(len(cands)) if (m := medians_of(measured, i, depth))}
    if not medians:
        raise ValueError(f"nothing measured at depth {depth}")
    best = min(v["score_s"] for v in medians.values())
    winner = min(i for i, v in medians.items() if v["score_s"] <= best * (1 + NEAR_TIE))
    return winner, medians


def medians_of(measured: Sequence[Measurement], candidate: int, depth: int) -> dict | None:
    """One candidate's medians at a depth (prefill, decode, score, runs); None if not measured."""
    mine = [m for m in measured if m.candidate == candidate and m.depth == depth]
    if not mine:
        return None
    return {"prefill_tps": statistics.median(m.prefill_tps for m in mine),
            "decode_tps": statistics.median(m.decode_tps for m in mine),
            "score_s": statistics.median(m.score_s for m in mine), "runs": len(mine)}


def depth_ranges(depths: Sequence[int]) -> list[int]:
    """depth_max for each measured depth: halfway to the next one; the last covers any depth."""
    ds = sorted(depths)
    return [(a + b) // 2 for a, b in zip(ds, ds[1:])] + [1 << 30]


def render_choices(model: str, table: list[tuple[int, int, LlamaCppSettings, dict, bool]]) -> str:
    lines = [f"## Tuned plan for {model}", "",
             f"score = {CHUNK_TOKENS} prompt tokens at the prefill rate + {DECODE_TOKENS} tokens at the decode "
             f"rate, at the depth, + {REGRID_TOKENS} more prompt tokens where the prompt cache reuses whole "
             f"blocks only (median of the runs; near-ties within {NEAR_TIE:.0%} go to the earlier candidate)",
             "", "| depth | candidate | threads | n_ubatch | flash attn | prompt reuse | prefill tok/s | decode tok/s "
             "| score s | chosen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d, i, c, m, won in table:
        reuse = f"to the token (min chunk {m['min_chunk']})" if m.get("min_chunk") else "whole blocks"
        lines.append(f"| {d:,} | {i} | {c.n_threads} | {c.n_ubatch} | {'on' if c.flash_attn else 'off'} | {reuse} | "
                     f"{m['prefill_tps']:,.1f} | {m['decode_tps']:,.1f} | {m['score_s']:.3f} | "
                     f"{'**yes**' if won else ''} |")
    return "\n".join(lines) + "\n"


def candidates(cores: int, logical: int, flash: Sequence[bool] = (False, True),
               ubatches: Sequence[int] = (256, 512)) -> list[LlamaCppSettings]:
    """The llama.cpp settings `tune` measures, in order (near-ties go to the earlier one): the
    physical cores first, then every logical CPU if there are more."""
    threads = [cores] + ([logical] if logical > cores else [])
    return [LlamaCppSettings(n_threads=t, n_threads_batch=t, n_batch=max(ubatches), n_ubatch=u, flash_attn=fa)
            for t in threads for fa in flash for u in sorted(ubatches, reverse=True)]


def wait_entry(runs: Sequence[tuple[str, Measurement]], depths: Sequence[int], model: str) -> tuple[dict | None, str]:
    """The plan's thread_wait entry for the model and the table tune prints, from llama.cpp's
    winners timed spinning and waiting passively (tune._measure_thread_wait): passive, the good
    neighbour, unless it costs this engine more than NEAR_TIE over the depths (a barrier that
    sleeps at once makes each step wake its threads); (None, "") when nothing was measured."""
    at = {w: {d: m for d in depths if (m := medians_of([r for k, r in runs if k == w], _winner(runs, d), d))}
          for w in ("spin", "passive")}
    both = [d for d in depths if d in at["spin"] and d in at["passive"]]
    if not both:
        return None, ""
    ratio = sum(at["passive"][d]["score_s"] for d in both) / sum(at["spin"][d]["score_s"] for d in both)
    wait = "passive" if ratio <= 1 + NEAR_TIE else "spin"
    why = (f"waiting passively scored {ratio:.2f}x spinning over depths {', '.join(f'{d:,}' for d in both)} "
           f"({'within' if wait == 'passive' else 'more than'} the {NEAR_TIE:.0%} allowed for the good neighbour)")
    lines = [f"## Thread wait for {model}: {wait}", "", why, "",
             "| depth | wait | prefill tok/s | decode tok/s | score s |", "|---|---|---|---|---|"]
    lines += [f"| {d:,} | {w} | {at[w][d]['prefill_tps']:,.1f} | {at[w][d]['decode_tps']:,.1f} | "
              f"{at[w][d]['score_s']:.3f} |" for d in both for w in ("spin", "passive")]
    entry = {"thread_wait": wait, "why": why, "measured": {str(d): {w: at[w][d] for w in at} for d in both}}
    return entry, "\n".join(lines) + "\n"


def _winner(runs: Sequence[tuple[str, Measurement]], depth: int) -> int:
    return next((m.candidate for _, m in runs if m.depth == depth), -1)
