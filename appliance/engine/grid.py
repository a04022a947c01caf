"""The prefill grid: prompts are computed in chunks cut at fixed absolute positions (multiples of
`chunk`), whatever else runs. Everything exact about the prompt cache rests on it: a prefix kept
or restored in whole grid blocks, then prefilled on the same cuts, gives the logits a cold run
gives. The scheduler, the prompt cache, the draft model and bench's raw reference all cut here.

    positions   0 .. chunk-1 | chunk .. 2*chunk-1 | ...      a block = one chunk of the grid
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Grid:
    chunk: int

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"the prefill grid's chunk must be positive, got {self.chunk}")

    def floor(self, n: int) -> int:
        """The last grid line at or before n: the positions of n that fill whole blocks."""
        return n // self.chunk * self.chunk

    def chunk_end(self, start: int, end: int) -> int:
        """Where the chunk that starts at `start` ends, for a prompt of `end` positions: the next
        grid line after `start`, or `end` if that comes first."""
        return min(end, (start // self.chunk + 1) * self.chunk)

    def chunks(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The chunks [a, b) that cover [start, end) on the grid, in order."""
        while start < end:
            stop = self.chunk_end(start, end)
            yield start, stop
            start = stop

    def reusable(self, shared: int, n_prompt: int) -> int:
        """Of a prompt of `n_prompt` tokens sharing `shared` leading tokens with a cached state,
        the positions that may be reused: whole blocks, never the prompt's last token (its
        logits are needed, so it is always computed)."""
        return self.floor(min(shared, n_prompt - 1))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share. Slices compare in C, and the usual answer (all
    of the shorter, or all but a few at the end) is found in a few of them: the draft model
    asks this of a whole context on every drafting step."""
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
