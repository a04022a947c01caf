"""Does the loaded runner compute a prompt the same however it is cut into chunks? Proven at
engine start (`check_chunk_invariance`), the way `spec.probe.check_exact` proves that a k-row
verify equals k one-row steps; the answer decides how finely the prompt cache may reuse a
cached prefix (grid.Grid's two regimes).

A cache hit at position r computes the rest of the prompt from r in chunks that a cold run
never used (the cold run cut on the grid; the hit starts off it), on top of KV that an earlier
request computed in chunks of its own. Reuse at any position is exact only if every position's
KV, and the last row's logits, come out the same in any chunk of at least m rows. So for each
candidate m, smallest first, the probe computes a cold reference (the prompt on the grid: its
logits and its saved state) and then the shapes a hit makes, each compared bit for bit with it:

    pieces    eight m-row chunks in a row, then the rest
    tail      the prompt's last m rows alone, on the reference's KV
    crossing  a piece that starts a row before a grid line and runs across it
    follow-up an earlier prompt ending inside the last block, reused to within 5 tokens of its
              end, the rest cut as a hit cuts it (an off-grid start, then the grid)

Measured here (llama.cpp 0.3.36, SmolLM2-135M Q4_1, 2 threads): with f16 KV and the default
attention every chunk of 2 or more rows agrees with the grid's and a one-row chunk does not
(another matmul path): m = 2. With flash attention and f16 KV, llama.cpp's CPU kernel computes
a chunk of at least 64 rows in tiles of 64 query rows by 64 keys (each row's scores, softmax
and sum the same whatever rows share its tile) and a shorter chunk row by row in another
precision: m = 64. A candidate needing a longer prompt than the probe's (11 m + 1 positions)
gets one of its own, so the usual case pays for the short probe only. The torch runner on its
own ops (row-wise attention for every span, `--torch-attention ops`) agrees for every cut, one
row included: m = 1. With its CPU decode attention kernel (the default on a CPU) spans of up
to 16 rows take the kernel and longer ones the ops: m = 17. A sample of cuts is a test, not a proof of every cut; the cuts are the ones a
hit makes, and a difference anywhere sends the cache back to grid reuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..grid import Grid
from ..runners.base import ModelRunner, Span

# min_chunk values tried, smallest first; 17: the torch runner on a CPU computes spans of up to
# 16 rows (decode steps, verifies) with its decode attention kernel, longer ones as chunks; 64:
# llama.cpp's CPU flash attention tiles chunks of at least 64 rows (GGML_FA_TILE_Q)
CANDIDATES = (1, 2, 4, 16, 17, 64)
TAIL_ROOM = 64               # positions of the probe prompt past its last grid line


@dataclass(frozen=True)
class ChunkInvariance:
    """What the probe found: the smallest m for which every case agreed (0: none, so reuse
    stays on the grid), how many cuts were compared, and the first difference of each
    candidate that failed."""

    min_chunk: int
    cases: int
    failed: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"min_chunk": self.min_chunk, "any_position": self.min_chunk > 0, "cases": self.cases,
                "failed": list(self.failed)}


def probe_prompt(runner: ModelRunner, chunk: int) -> list[int]:
    """A prompt that crosses a grid line and leaves TAIL_ROOM positions past it, within one
    slot's context (a small context probes what fits)."""
    n = min(chunk + TAIL_ROOM, runner.info.n_ctx - 8)
    text = "In the archive, every ledger was copied twice and checked against the first. " * 200
    ids = runner.tokenize(text, add_special=True)
    while len(ids) < n:
        ids = ids + ids
    return ids[:max(n, 2)]


def check_chunk_invariance(runner: ModelRunner, slot: int, prompt: Sequence[int], chunk: int,
                           candidates: Sequence[int] = CANDIDATES) -> ChunkInvariance:
    """The smallest candidate m (at most half the chunk) for which every cut a cache hit makes
    gives the cold reference's logits and state bit for bit. The slot is left empty."""
    prompt = tuple(prompt)
    ref_logits, ref_state = _run(runner, slot, prompt, Grid(chunk), 0, ())
    cases, failed = 0, []
    for m in candidates:
        if 2 * m > chunk:
            break
        if 11 * m + 1 > len(prompt):              # the cases need 11 m positions and one more
            longer = _longer(prompt, 11 * m + 1, chunk, m)
            if len(longer) > runner.info.n_ctx - 8:
                break
            prompt = longer
            ref_logits, ref_state = _run(runner, slot, prompt, Grid(chunk), 0, ())
        grid = Grid(chunk, m)
        for name, (keep, pieces) in _cases(len(prompt), chunk, m).items():
            cases += 1
            logits, state = _run(runner, slot, prompt, grid, keep, pieces, ref_state)
            if not (np.array_equal(logits, ref_logits) and state == ref_state):
                diff = float(np.abs(logits - ref_logits).max())
                failed.append(f"m={m}: {name} (logits max diff {diff:.3g}, state {'equal' if state == ref_state else 'differs'})")
                break
        else:
            runner.truncate(slot, 0)
            return ChunkInvariance(m, cases, tuple(failed))
    runner.truncate(slot, 0)
    return ChunkInvariance(0, cases, tuple(failed))


def _longer(prompt: tuple[int, ...], n: int, chunk: int, m: int) -> tuple[int, ...]:
    """The prompt repeated to at least n positions, and on to m past a grid line if it would
    end fewer than m past one (the reference's last chunk, cut on the grid, is then at least m
    rows, as a server's cold run leaves it)."""
    if 0 < n % chunk < m:
        n += m - n % chunk
    return (prompt * (n // len(prompt) + 1))[:n]


def _cases(n: int, chunk: int, m: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each case: how many of the reference's positions to keep, and the cut points after
    which the rest is computed by the any-position grid."""
    line = Grid(chunk).floor(n - 1) or chunk
    end = n - max(2 * m, 24)                   # an earlier prompt that ended inside the last block
    return {  # the cheapest first: a candidate that fails mostly fails on short pieces
        "pieces": (n - 9 * m - 1, tuple(n - 9 * m - 1 + m * (i + 1) for i in range(8))),
        "tail": (n - m, ()),
        "crossing": (line - 1, ()) if line - 1 > 0 and line + m < n else (n - 3 * m, ()),
        # computed from its last grid line, or from m before its end, as a server cuts it
        "follow-up": (min(Grid(chunk).floor(end - 1), end - m), (end, end - 5)),
    }


def _run(runner: ModelRunner, slot: int, prompt: tuple[int, ...], grid: Grid, keep: int,
         cuts: tuple[int, ...], ref_state: bytes | None = None) -> tuple[np.ndarray, bytes]:
    """Restore the reference truncated to `keep` (or start empty), then compute up to each cut
    in turn (a cut below the current end truncates back to it: a follow-up reusing less than
    the earlier prompt computed), then to the end; the last row's logits and the saved state."""
    if ref_state is not None and keep > 0:
        runner.restore(slot, ref_state)
        runner.truncate(slot, keep)
    else:
        runner.truncate(slot, 0)
        keep = 0
    pos, logits = keep, None
    for target in (*cuts, len(prompt)):
        if target <= pos:
            runner.truncate(slot, target)
            pos = target
            continue
        for a, b in grid.chunks(pos, target):
            (out,) = runner.forward([Span(slot, prompt[a:b], a, 1)])
            logits = out[-1]
        pos = target
    runner.truncate(slot, len(prompt))
    return logits, runner.save(slot)
