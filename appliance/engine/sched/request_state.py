"""A request inside the scheduler, from admission to its last event: where it is (slot,
positions computed), what it has produced (its `RequestOutput`), its drafting state, and the
clocks its `Timings` are made of. A request with n > 1 is n of these, one per choice, held
together by `Choices`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..lora import LoraSet
from ..output.request_output import RequestOutput
from ..spec import Drafting
from ..types import ChoiceEnd, Done, Request, Timings, Usage


@dataclass
class Active:
    req: Request
    prompt: list[int]
    output: RequestOutput
    spec: Drafting | None = None       # its drafting state, when it speculates
    t_submit: float = field(default_factory=time.perf_counter)
    slot: int = -1
    n_past: int = 0                    # positions of this request in its slot's KV
    cancelled: bool = False
    cached: int = 0                    # prompt positions reused from the prompt cache
    cache_exact: int | None = None     # reused inexactly (--prompt-cache fast): leading positions still exact
    t_admit: float = 0.0
    t_prefill: float = 0.0             # start of the first prefill chunk
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0             # tokens committed by decode steps (several per verify)
    expert_base: tuple[int, int] | None = None   # its slot's expert (lookups, hits) at admission
    group: Choices | None = None       # the request's choices, when it asked for n > 1
    follows: Active | None = None      # a choice waiting for its leader's prefill, to take a copy of it
    reserved: bool = True              # it has a max_tokens (a shared KV pool holds them for it: kv_pool.py)
    lora: LoraSet = ()                 # the LoRA adapter set it runs under (engine/lora.py)
    task: int = 0                      # the request's number in this engine (llama-server's id_task in /slots)

    @property
    def prefilling(self) -> bool:
        return self.follows is None and self.n_past < len(self.prompt)

    @property
    def decoding(self) -> bool:
        return self.follows is None and self.n_past >= len(self.prompt)

    @property
    def members(self) -> list[Active]:
        """Every choice of its request (itself alone for n = 1)."""
        return self.group.members if self.group is not None else [self]

    @property
    def out(self) -> list[int]:
        """The tokens sampled so far."""
        return self.output.tokens

    def room(self, n_ctx: int) -> int:
        """How many drafted tokens a decode step of this request could still use."""
        return min(self.output.limit - len(self.out), n_ctx - self.n_past - 1) - 1

    def usage(self) -> Usage:
        return Usage(len(self.prompt), self.output.n_generated, self.cached)

    def timings(self, n_ctx: int, speculation: str, experts: tuple[int, int] | None = None) -> Timings:
        """`experts`: its slot's expert-cache (lookups, hits) now, when the runner has a cache."""
        queue_ms = 1000.0 * ((self.t_admit or time.perf_counter()) - self.t_submit)
        drafted, accepted = self.spec.totals() if self.spec is not None else (0, 0)
        return Timings(prompt_n=len(self.prompt) - self.cached, cache_n=self.cached, prompt_ms=self.prompt_ms,
                       predicted_n=self.decode_tokens, predicted_ms=self.decode_ms, queue_ms=queue_ms,
                       n_ctx=n_ctx, tokens_per_step=self.decode_tokens / self.decode_steps if self.decode_steps else 1.0,
                       draft_n=drafted, draft_n_accepted=accepted, speculation=speculation,
                       cache_reuse="exact" if self.cache_exact is None else "inexact",
                       expert_hit_rate=self._expert_hit_rate(experts))

    def _expert_hit_rate(self, now: tuple[int, int] | None) -> float | None:
        if now is None or self.expert_base is None:
            return None
        lookups, hits = now[0] - self.expert_base[0], now[1] - self.expert_base[1]
        return hits / lookups if lookups else None


@dataclass
class Choices:
    """The choices of a request with n > 1. The leader (choice 0) prefills the prompt; the others
    take slots of their own, wait, and when the leader's last prompt chunk is computed take a
    copy of its KV and sample their first token from the same logits row (`Scheduler._fork`):
    one prefill for n replies. The request ends, with one Done, when every choice has ended."""

    members: list[Active]
    ends: dict[int, ChoiceEnd] = field(default_factory=dict)

    def end(self, act: Active, reason: str) -> bool:
        """Record that `act` ended; whether that was the last choice."""
        out = act.output
        self.ends[out.index] = ChoiceEnd(out.index, reason, out.stop_string, out.reply)  # type: ignore[arg-type]
        return len(self.ends) == len(self.members)

    def done(self, done: Done) -> Done:
        """The request's Done: choice 0's own fields, every choice's end, the prompt counted once
        and every choice's tokens (OpenAI's usage for n > 1)."""
        lead = self.members[0]
        usage = Usage(len(lead.prompt), sum(m.output.n_generated for m in self.members), lead.cached)
        first = self.ends[0]
        return Done(done.request_id, first.finish_reason, usage, done.timings, first.stop_string, first.token_ids,
                    tuple(self.ends[i] for i in sorted(self.ends)))
