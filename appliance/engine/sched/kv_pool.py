"""The cells of a KV pool the slots share (`--kv-unified`): who holds how many, who may start,
and how far a request without `max_tokens` may grow.

With a KV stream per slot (the default) a slot's n_ctx positions are its own and nothing here
runs. With one pool of n_ctx cells for every slot, a request may fill all of it while the others
need little, so the scheduler counts:

    held     a running request with max_tokens (its own or --max-tokens-default) holds its
             prompt plus max_tokens from admission on: it never runs out of room; one without
             holds its prompt plus the tokens it has sampled (the last one's cell is computed
             next step), and takes cells as it goes
    idle     a slot no request holds keeps its cached prompt (and a reply being settled) in the
             pool: the prompt cache's cells, evicted to its RAM and disk tiers when a request
             needs them (`PromptCache.evict`)
    free     n_ctx - held - idle

A request is admitted when its prompt plus its max_tokens (else one token) fit in what is free
once every idle slot but the one sharing its longest prefix is evicted; else it waits, and so
does everyone behind it (first come, first served). At each step a growing request takes one
cell, and drafts only from what is left; one that finds the pool full samples its last token
and ends with finish_reason "length", as a request that reaches a slot's n_ctx does.

Every count is an upper bound (choices that share their prompt's cells are counted once each),
so llama.cpp always finds the cells the scheduler promised.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .request_state import Active


def held(act: Active) -> int:
    """Cells `act` holds or may take before its next step."""
    if act.reserved:
        return len(act.prompt) + act.output.limit
    return len(act.prompt) + len(act.out)


def need(act: Active) -> int:
    """Cells `act`, every choice of it, needs free to be admitted."""
    lead = act.members[0]
    return len(act.members) * (len(lead.prompt) + (lead.output.limit if lead.reserved else 1))


class SharedPool:
    def __init__(self, capacity: int, used: Callable[[int], int]) -> None:
        self.capacity = capacity
        self.used = used          # the runner's kv_used(slot)

    def free(self, slots: Sequence[Active | None], idle_cells: Callable[[int], int]) -> int:
        """Cells no running request holds and no idle slot keeps."""
        return self.capacity - sum(held(a) if a is not None else idle_cells(i) for i, a in enumerate(slots))

    def grant(self, decoding: Sequence[Active], rooms: list[int], free: int) -> list[int]:
        """Before a step: each growing request (in `decoding`, admission order) takes a cell for
        the token it samples now (computed next step), or, with none left, samples that token and
        ends; then drafts are cut to what is left. Returns `rooms` (each request's room for
        drafts) so cut."""
        growing = [i for i, a in enumerate(decoding) if not a.reserved]
        for i in growing:
            if free >= 1:
                free -= 1
            else:
                act = decoding[i]
                act.output.limit = len(act.out) + 1   # its last token: finished() says "length"
                rooms[i] = 0
        for i in growing:
            rooms[i] = max(0, min(rooms[i], free))
            free -= rooms[i]
        return rooms
