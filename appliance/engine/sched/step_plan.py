"""What one scheduler step runs: a decode span (last token plus its draft) for every decoding
request, then prompt chunks, oldest request first, while the step's prompt-token budget lasts.
Chunks are cut on the prefill grid and never split, so a prompt is computed in the same shapes
whatever else runs.

LoRA adapters apply to the runner's whole context, so a step runs the requests of one adapter
set (engine/lora.py); where the running requests have several, each set takes a step in turn
(`lora_turn`), and the others wait in their slots. A request's set never changes what it
computes, only which step computes it. Requests under adapters decode serially: the runner's
proof that a verify equals its steps (spec/probe.py) was made without them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..grid import Grid
from ..lora import BASE, LoraSet
from ..runners.base import Span
from .request_state import Active


@dataclass(frozen=True)
class StepPlan:
    spans: list[Span]
    owners: list[Active]          # the request of each span
    decoding: list[bool]          # whether each span is a decode span (else a prompt chunk)

    @property
    def decode_rows(self) -> int:
        return sum(self.decoding)

    @property
    def rows(self) -> int:
        return sum(len(s.tokens) for s in self.spans)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(s.tokens) for s, dec in zip(self.spans, self.decoding) if not dec)

    def prefilled(self, mode: str = "draft") -> list[tuple[int, list[int]]]:
        """(slot, prompt up to the chunk's end) of the prompt chunks whose requests draft in
        `mode`: what the draft model follows."""
        return [(a.slot, a.prompt[:s.start_pos + len(s.tokens)]) for a, s, dec
                in zip(self.owners, self.spans, self.decoding) if not dec and a.spec and a.spec.mode == mode]


def lora_turn(running: Sequence[Active], step: int) -> LoraSet:
    """The adapter set this step runs: the only one, or with several, each in turn by step."""
    sets = sorted({a.lora for a in running})
    return sets[step % len(sets)] if sets else BASE


def plan_step(decoding: Sequence[Active], drafts: Sequence[tuple[int, ...]],
              prefilling: Sequence[Active], grid: Grid, budget: int) -> StepPlan:
    """Decode spans for `decoding` (with their `drafts`), then one grid chunk for each of
    `prefilling` in order while `budget` prompt tokens last (a chunk that does not fit waits
    for the next step, unless it is the step's first)."""
    spans: list[Span] = []
    owners: list[Active] = []
    for act, draft in zip(decoding, drafts):
        spans.append(Span(act.slot, (act.out[-1], *draft), act.n_past, 1 + len(draft), act.lora))
        owners.append(act)
    left = budget
    for act in prefilling:
        end = grid.chunk_end(act.n_past, len(act.prompt))
        n = end - act.n_past
        if n > left and left < budget:
            break  # chunks are never split: the next step takes it whole
        last = end == len(act.prompt)
        spans.append(Span(act.slot, tuple(act.prompt[act.n_past:end]), act.n_past, 1 if last else 0, act.lora))
        owners.append(act)
        left -= n
        if left <= 0:
            break
    return StepPlan(spans, owners, [i < len(decoding) for i in range(len(spans))])
