"""Prompt lookup: drafts copied from the request's own context. A request's prompt and output,
indexed by their n-grams; the draft is what followed the most recent earlier occurrence of the
context's last n tokens (longest n first). Free to compute, and right where a reply copies:
quoted code, paths, tool-call arguments."""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """The context of one request (prompt, then output as it grows), indexed by its n-grams for
    prompt lookup. `propose` never matches the context's own suffix."""

    def __init__(self, tokens: Sequence[int] = (), n_min: int = 1, n_max: int = 4) -> None:
        self.toks: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            end = len(self.toks)
            for n, m in self.maps.items():  # the n-grams ending here now have a continuation
                if end >= n:
                    m[tuple(self.toks[end - n:end])] = end
            self.toks.append(int(t))

    def propose(self, k: int) -> tuple[int, ...]:
        """What followed the most recent earlier occurrence of the longest matching suffix."""
        end = len(self.toks)
        for n in sorted(self.maps, reverse=True):
            if end < n:
                continue
            at = self.maps[n].get(tuple(self.toks[end - n:]))
            if at is not None:
                return tuple(self.toks[at:at + k])
        return ()


