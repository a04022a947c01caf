"""The prefill grid: prompts are computed in chunks cut at fixed absolute positions (multiples of
`chunk`), whatever else runs. Everything exact about the prompt cache rests on it: a prefix kept
or restored, then prefilled the way a cold run prefills, gives the logits a cold run gives. The
scheduler, the prompt cache, the draft model and bench's raw reference all cut here.

    positions   0 .. chunk-1 | chunk .. 2*chunk-1 | ...      a block = one chunk of the grid

Two regimes, chosen at engine start by what the loaded runner proves (cache/invariance.py):

- `min_chunk` 0, grid reuse: nothing is known about chunks of other shapes, so a cached prefix
  is reused only up to a grid line. A cold and a warm run then compute every chunk past it in
  the very same shapes, exact by construction, and a follow-up recomputes up to chunk - 1
  tokens it already had.
- `min_chunk` m > 0, any-position reuse: the runner computes every position of a chunk of at
  least m rows exactly as the grid's chunks do (llama.cpp on a CPU with f16 KV and its default
  attention: m = 2, a one-row chunk takes another matmul path). A prefix is reused to the
  token, leaving at least m tokens to compute; the rest is cut in chunks of `chunk` rows from
  wherever it starts (no need to come back to the grid's lines: one 449-token follow-up is one
  forward, not 372 + 77), and no chunk is ever cut shorter than m rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

# Fewer shared tokens than this (or than a chunk, if smaller) are not reused: they save less
# than a block of prefill, and every cold request shares the template's first tokens (BOS,
# "<|im_start|>system\n") with the last one, which would otherwise count as a cache hit.
MIN_REUSE = 64


@dataclass(frozen=True)
class Grid:
    chunk: int
    min_chunk: int = 0   # 0: reuse at grid lines only; m: any position, chunks of >= m rows

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"the prefill grid's chunk must be positive, got {self.chunk}")
        if self.min_chunk < 0 or (self.min_chunk and 2 * self.min_chunk > self.chunk):
            raise ValueError(f"min_chunk must be 0 or at most half the chunk ({self.chunk}), got {self.min_chunk}")

    @property
    def any_position(self) -> bool:
        return self.min_chunk > 0

    @property
    def min_reuse(self) -> int:
        return min(MIN_REUSE, self.chunk)

    def floor(self, n: int) -> int:
        """The last grid line at or before n: the positions of n that fill whole blocks."""
        return n // self.chunk * self.chunk

    def chunk_end(self, start: int, end: int) -> int:
        """Where the chunk that starts at `start` ends, for a prompt of `end` positions: the next
        grid line after `start`, or `end` if that comes first. With `min_chunk` m: `chunk` rows
        on from `start` (a cold prompt, starting at 0, is still cut on the grid's lines), but the
        prompt's last piece is left m rows, so no piece is shorter than m (unless the whole
        rest is) and none longer than `chunk`."""
        m = self.min_chunk
        if not m:
            return min(end, (start // self.chunk + 1) * self.chunk)
        stop = min(end, start + self.chunk)
        return end - m if 0 < end - stop < m else stop

    def chunks(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The chunks [a, b) that cover [start, end), in order."""
        while start < end:
            stop = self.chunk_end(start, end)
            yield start, stop
            start = stop

    def reusable(self, shared: int, n_prompt: int) -> int:
        """Of a prompt of `n_prompt` tokens sharing `shared` leading positions with a cached state
        (positions that are exact to reuse), how many may be reused: whole blocks, or with
        `min_chunk` m any number of at least `min_reuse` leaving at least m tokens to compute;
        never the prompt's last token (its logits are needed, so it is always computed)."""
        if self.min_chunk:
            n = min(shared, n_prompt - self.min_chunk)
            return n if n >= self.min_reuse else 0
        return self.floor(min(shared, n_prompt - 1))

    def keepable(self, n_computed: int, n_prompt: int) -> int:
        """Of a prompt whose first `n_computed` positions are in the KV (prefilled on this grid,
        or reused), how many a later request may reuse exactly: whole blocks, or with `min_chunk`
        m all of them, unless the prompt was too short to be cut in chunks of m rows."""
        n = min(n_computed, n_prompt)
        if self.min_chunk:
            return n if n_prompt >= self.min_chunk else 0
        return self.floor(n)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share. Slices compare in C, and the usual answer (all
    of the shorter, or all but a few at the end) is found in a few of them: the draft model
    asks this of a whole context on every drafting step."""
    if type(a) is not type(b):  # a tuple never equals a list, slice for slice
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo], and the first difference is before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
