"""The scheduler: slots, admission, continuous batching, cancellation, the context limit.

Design
------
The runner holds `n_slots` sequences. A request is validated at submit (its prompt plus its
`max_tokens` must fit one slot's `n_ctx`, else `ContextOverflow` before any work) and waits in
a bounded FIFO queue; past `max_queue` it is refused with `QueueFull`.

Each `step()` is one iteration of continuous batching:
  1. cancelled requests leave (queue or slot) -- so an abort takes effect within one step;
  2. waiting requests take free slots: the prompt cache (`cache.PromptCache.admit`) chooses the
     slot and says how much of the prompt is already there;
  3. every decoding request contributes its last sampled token, and the draft the speculator
     proposes for it (`spec.Speculator.propose`), to the batch;
  4. prefilling requests, oldest first, contribute one prompt chunk each while the step's
     prompt-token budget lasts (`step_plan.plan_step`). Chunks are cut on the prefill grid
     (`grid.Grid`), so a prompt is always cut at the same places whatever else runs: its KV,
     and so its output, does not depend on the other requests;
  5. one `runner.forward` over all of that; then each request's `RequestOutput` samples its
     rows. A decode span's rows are sampled in order exactly as serial steps would be, up to
     the first token that is not the draft's next, so speculation never changes the output.
A long prompt therefore never holds other streams for more than one chunk per step, and a new
request joins the running batch at the next step. When a request ends, `PromptCache.release`
keeps its prompt's KV in its slot for the next request that shares it.

A request with n > 1 is n choices (`request_state.Choices`), admitted together when n slots
are free: choice 0 prefills; the others wait in their slots, and when choice 0's last prompt
chunk is computed each takes a copy of its KV (`runner.copy_prefix`) and samples its first
token from the same logits row (`_fork`), then they decode as any request does. One prefill for
n replies; one `Done` when the last choice ends.

The scheduler holds its parts and keeps the queue, the slots and the step; what a token means
(sampling, stops, tool calls, logprobs) is `RequestOutput`'s, what is cached is `PromptCache`'s,
what is drafted is `Speculator`'s.

With `--kv-unified` the slots share one pool of n_ctx cells (`kv_pool.SharedPool`): admission
also waits for the pool's cells, idle slots' cached prompts are evicted to the cache's tiers when
a request needs their cells, and a request without max_tokens grows while cells are free.

Invariant: a request in a slot has exactly `n_past` positions in that slot's KV.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter, deque
from typing import Callable, Sequence

import numpy as np

from ...config import EngineConfig
from ...errors import ApplianceError, ContextOverflow, InvalidRequest, QueueFull
from ..cache.prompt_cache import PromptCache
from ..lora import resolve
from ..output.constraints import Matcher
from ..output.dry import BreakerTables
from ..output.parser import OutputParser
from ..output.request_output import RequestOutput
from ..runners.base import ModelRunner, Span
from ..spec import Speculator
from ..stats import EngineStats
from ..types import Accepted, Done, Error, Event, Progress, Request
from .kv_pool import SharedPool, need
from .request_state import Active, Choices
from .step_plan import StepPlan, lora_turn, plan_step


class Scheduler:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig, emit: Callable[[Event], None],
                 cache: PromptCache | None = None, spec: Speculator | None = None) -> None:
        self.runner, self.cfg, self.emit = runner, cfg, emit
        self.cache = cache or PromptCache.from_config(runner, cfg)
        self.grid = self.cache.grid  # one grid: the chunks prefilled are the ones the cache reuses
        self.spec = spec or Speculator()
        self.n_ctx = runner.info.n_ctx
        self.breakers = BreakerTables(runner.detokenize, lambda text: runner.tokenize(text, False, False),
                                      runner.info.n_vocab)   # DRY's, per list of breaker strings
        self.pool = SharedPool(self.n_ctx, runner.kv_used) if runner.info.kv_unified else None
        self.waiting: deque[Active] = deque()
        self.slots: list[Active | None] = [None] * runner.info.n_slots
        self.last: list[Active | None] = [None] * runner.info.n_slots   # what each slot served last (GET /slots)
        self.n_tasks = 0
        self.by_id: dict[str, Active] = {}
        self.steps = 0
        self.decode_rows_seen: Counter[int] = Counter()
        self.tokens_generated = 0
        self.holding = False    # admit nobody (the engine waits for the running requests to end)
        # the torch runner's expert cache, when it has one: engine-wide and per-slot counters
        self._expert_stats = getattr(runner, "expert_stats", lambda: None)
        self._expert_counts = getattr(runner, "expert_counts", lambda slot: None)

    # -- requests in ---------------------------------------------------------------------
    def submit(self, req: Request, prompt: list[int], matcher: Matcher | None = None,
               parser: OutputParser | None = None,
               more: Sequence[tuple[Matcher | None, OutputParser | None]] = ()) -> None:
        """Validate and queue; emits Accepted, or Error and nothing else. `more`: the matcher and
        parser of each further choice of a request with n > 1."""
        try:
            act = self._admit_check(req, prompt, [(matcher, parser), *more])
        except ApplianceError as e:
            self.emit(Error(req.id, *e.to_wire()))
            return
        self.n_tasks += 1
        for choice in act.members:
            choice.task = self.n_tasks
        self.waiting.append(act)
        self.by_id[req.id] = act
        self.emit(Accepted(req.id, len(prompt), 0))

    def _admit_check(self, req: Request, prompt: list[int],
                     outputs: Sequence[tuple[Matcher | None, OutputParser | None]]) -> Active:
        n, p = len(prompt), req.params
        most = min(self.cfg.max_choices, len(self.slots))
        if req.n > most:
            raise InvalidRequest(f"n={req.n} asks for more choices than this server generates at once: at most "
                                 f"{most} (each choice takes a slot; --max-choices {self.cfg.max_choices}, "
                                 f"--n-slots {len(self.slots)})", param="n")
        if n == 0:
            raise ContextOverflow("the prompt is empty after tokenization", n_prompt_tokens=0, n_ctx=self.n_ctx)
        asked = p.max_tokens or self.cfg.max_tokens_default   # 0: up to the end of the context
        if p.max_tokens_ceiling and n + asked > self.n_ctx:
            asked = 0
        max_tokens = asked or (self.n_ctx - n)
        if n + max_tokens > self.n_ctx or max_tokens < 1:
            raise self._overflow(req, n, asked)
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests "
                            "are waiting; retry later", retry_after=1)
        seed = p.seed if p.seed is not None else self.cfg.seed
        # any integer is a seed (OpenAI allows negatives); PCG64 takes non-negative ones
        seed = seed % 2**64 if seed is not None else int.from_bytes(os.urandom(8), "little")
        if len(outputs) < req.n:   # a request without grammar or parser: none for the other choices either
            assert outputs[0] == (None, None), "each choice needs its own matcher and parser"
            outputs = [outputs[0]] * req.n
        limit = min(max_tokens, self.n_ctx - n)
        lora = resolve(req.lora, self.runner.info.adapters)   # under adapters it decodes serially (step_plan.py)
        choices = [Active(req, list(prompt), RequestOutput(
            req.id, p, (seed + i) % 2**64, limit, self.runner.info.eog_ids,
            self.runner.detokenize, matcher, parser, index=i, dry=self.breakers.dry(p, prompt, limit),
            n_vocab=self.runner.info.n_vocab), self.spec.start(prompt, "off" if lora else req.speculate),
            reserved=asked > 0, lora=lora) for i, (matcher, parser) in enumerate(outputs[:req.n])]
        if req.n > 1:
            group = Choices(choices)
            for act in choices:
                act.group, act.follows = group, (choices[0] if act is not choices[0] else None)
        return choices[0]

    def _overflow(self, req: Request, n: int, asked: int) -> ContextOverflow:
        """The refusal of a prompt of `n` tokens that does not fit with `asked` max_tokens (0: none
        asked), saying what would fit: never a negative count."""
        param = "messages" if req.messages is not None else "prompt"
        ctx = f"the context of {self.n_ctx} tokens {'of the shared pool' if self.pool else 'per slot'}"
        if n >= self.n_ctx:
            over = f"over {ctx} by {n - self.n_ctx}" if n > self.n_ctx else f"all of {ctx}"
            cut = n - self.n_ctx + 1
            return ContextOverflow(f"the prompt alone is {n} tokens, {over}: shorten it by at least "
                                   f"{cut} token{'s' * (cut > 1)} to leave room for a reply",
                                   param=param, n_prompt_tokens=n, n_ctx=self.n_ctx)
        return ContextOverflow(f"this request needs {n} prompt tokens + {asked} max_tokens, more than {ctx}: "
                               f"ask for at most {self.n_ctx - n} max_tokens or shorten the prompt",
                               param=param, n_prompt_tokens=n, n_ctx=self.n_ctx, max_tokens=asked)

    def abort(self, request_id: str) -> None:
        act = self.by_id.get(request_id)
        if act is not None:
            for choice in act.members:
                choice.cancelled = True

    def fail_all(self, err: ApplianceError) -> None:
        """End every request with `err` (the runner failed under them); the slots are emptied."""
        for act in list(self.waiting) + [a for a in self.slots if a is not None]:
            if self.by_id.pop(act.req.id, None) is not None:   # once per request, whatever its choices
                self.emit(Error(act.req.id, *err.to_wire()))
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        self.cache.forget()  # the runner failed: trust no KV
        self.spec.reset()

    def rewire(self, cache: PromptCache, spec: Speculator) -> None:
        """New prompt cache and speculator, with no request in a slot: the runner now computes
        other bits (startup.upgrade), so no kept KV is reused. Waiting requests start drafting
        anew; admission resumes. The old cache's disk writer is the caller's to close first."""
        assert not self.running(), "rewire with requests in slots"
        self.cache, self.grid, self.spec = cache, cache.grid, spec
        for act in self.waiting:
            act.spec = spec.start(act.prompt, act.req.speculate)
        self.holding = False

    # -- state ---------------------------------------------------------------------------
    def running(self) -> bool:
        """Whether a request holds a slot."""
        return any(s is not None for s in self.slots)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.running()

    def stats(self) -> EngineStats:
        return EngineStats(
            steps=self.steps, slots_busy=sum(s is not None for s in self.slots), n_slots=len(self.slots),
            queue_depth=len(self.waiting), tokens_generated=self.tokens_generated,
            max_decode_batch=max(self.decode_rows_seen, default=0),
            kv_tokens=sum(a.n_past for a in self.slots if a is not None),
            kv_capacity=self.n_ctx if self.pool else len(self.slots) * self.n_ctx, kv_bytes=self.runner.info.kv_bytes,
            decode_batches=dict(self.decode_rows_seen), cache=self.cache.stats(), spec=self.spec.stats(),
            experts=self._expert_stats())

    # -- one iteration -------------------------------------------------------------------
    def step(self) -> StepPlan | None:
        """One iteration of continuous batching; what it ran (None: nothing to run)."""
        self._drop_cancelled()
        self._fill_slots()
        t0 = time.perf_counter()  # the draft model's forwards are part of the step
        plan = self._plan()
        if not plan.spans:
            return None
        for act, dec in zip(plan.owners, plan.decoding):
            if not act.t_prefill and not dec and act.req.return_progress:
                self._progress(act, t0)   # its prefill starts: what the cache gave
            act.t_prefill = act.t_prefill or t0
        t_fwd = time.perf_counter()
        logits = self.runner.forward(plan.spans)
        self.spec.after_forward(time.perf_counter() - t_fwd, plan.rows, all(plan.decoding),
                                plan.prefilled(self.spec.model_mode))
        sampled = []
        for act, span, rows, dec in zip(plan.owners, plan.spans, logits, plan.decoding):
            if dec:
                self._take_rows(act, span, rows)
            else:
                act.n_past += len(span.tokens)
                if act.req.return_progress:
                    self._progress(act, time.perf_counter())
                if span.n_logits:
                    followers = self._followers(act)
                    row = rows[-1] if not followers else np.array(rows[-1], copy=True)  # copies run between
                    self._sample(act, row)
                    for choice in followers:
                        self._fork(act, choice, row)
                        sampled.append(choice)
            if span.n_logits:
                sampled.append(act)
        self._account(plan, 1000.0 * (time.perf_counter() - t0))
        for act in sampled:
            reason = act.output.finished()
            if reason is not None:
                self._finish(act, reason)
        return plan

    def _progress(self, act: Active, now: float) -> None:
        self.emit(Progress(act.req.id, len(act.prompt), act.cached, act.n_past,
                           1000.0 * (now - act.t_prefill) if act.t_prefill else 0.0))

    def _account(self, plan: StepPlan, ms: float) -> None:
        for act, dec in zip(plan.owners, plan.decoding):
            if dec:
                act.decode_ms += ms
                act.decode_steps += 1
        prefills = [s for s, dec in zip(plan.spans, plan.decoding) if not dec]
        if len(prefills) == 1 and not plan.decode_rows:  # a clean measurement of one chunk at its depth
            self.cache.observe_prefill(prefills[0].start_pos, len(prefills[0].tokens), ms)
        self.steps += 1
        if plan.decode_rows:
            self.decode_rows_seen[plan.decode_rows] += 1

    def _drop_cancelled(self) -> None:
        for act in [a for a in self.waiting if a.cancelled]:
            self.waiting.remove(act)
            for choice in act.members:
                self._finish(choice, "cancelled")
        for act in self.slots:
            if act is not None and act.cancelled:
                self._finish(act, "cancelled")

    def _fill_slots(self) -> None:
        """The waiting requests, in order, take free slots: one per choice, all at once (a request
        whose choices do not all fit waits, and so does everyone behind it)."""
        while self.waiting and not self.holding:
            act = self.waiting[0]
            free = [i for i, s in enumerate(self.slots) if s is None]
            if len(free) < len(act.members):
                return
            keep, room = self._pool_room(act, free) if self.pool is not None else (None, None)
            if room is not None and room < 0:
                return
            self.waiting.popleft()
            for choice in act.members:   # the leader first: it alone may reuse a cached prefix
                offer = [keep] if keep is not None and choice is act else free
                at = self.cache.admit(choice.prompt, choice.req.cache_prompt and choice.follows is None, offer, room,
                                      choice.lora)
                free.remove(at.slot)
                choice.slot, choice.n_past, choice.cached = at.slot, at.reuse, at.reuse
                choice.t_admit = time.perf_counter()
                choice.cache_exact = at.exact if at.inexact else None
                choice.expert_base = self._expert_counts(at.slot)
                self.slots[at.slot] = choice

    def _pool_room(self, act: Active, free: list[int]) -> tuple[int, int]:
        """A shared pool: the slot the cache gives `act`'s leader (`keep`), and the cells free for
        it once that slot's own are counted (negative: `act` does not fit while the running
        requests hold theirs). Idle slots' cached prompts are evicted until it fits, that slot's last."""
        keep = self.cache.pick(act.prompt, act.req.cache_prompt, free, act.lora)
        want = need(act)
        if self.pool.free(self.slots, lambda i: 0) < want:   # type: ignore[union-attr]
            return keep, -1        # not even with every cached prompt gone: keep them while it waits

        def room() -> int:
            return self.pool.free(self.slots, self._idle_cells) + self._idle_cells(keep)  # type: ignore[union-attr]
        self._evict_until(lambda: room() >= want, last=keep)
        return keep, room()

    def _evict_until(self, enough: Callable[[], bool], last: int | None = None) -> None:
        """Evict idle slots' cached prompts (to the cache's tiers), the smallest first and `last`
        last, until `enough()`."""
        idle = sorted((i for i, a in enumerate(self.slots) if a is None and i != last), key=self._idle_cells)
        for slot in [None, *idle, *([] if last is None else [last])]:
            if slot is not None and self._idle_cells(slot):
                self.cache.evict(slot)
            if enough():
                return

    def _idle_cells(self, slot: int) -> int:
        return max(self.runner.kv_used(slot), self.cache.planned(slot))

    def _plan(self) -> StepPlan:
        lora = lora_turn([a for a in self.slots if a is not None and a.follows is None], self.steps)
        decoding = [a for a in self.slots if a is not None and a.decoding and a.lora == lora]
        rooms = [a.room(self.n_ctx) for a in decoding]
        if self.pool is not None and decoding:   # a growing request takes a cell a step, cached prompts giving theirs
            pool, growing = self.pool, sum(not a.reserved for a in decoding)
            self._evict_until(lambda: pool.free(self.slots, self._idle_cells) >= growing)
            rooms = pool.grant(decoding, rooms, pool.free(self.slots, self._idle_cells))
        drafts = self.spec.propose([a.spec for a in decoding], rooms, [a.slot for a in decoding],
                                   [a.n_past for a in decoding]) if decoding else []
        prefilling = sorted((a for a in self.slots if a is not None and a.prefilling and a.lora == lora),
                            key=lambda a: a.t_submit)
        return plan_step(decoding, drafts, prefilling, self.grid, self.cfg.step_token_budget)

    # -- choices (n > 1) ---------------------------------------------------------------------
    def _followers(self, act: Active) -> list[Active]:
        return [c for c in act.members if c.follows is act and not c.cancelled]

    def _fork(self, leader: Active, choice: Active, row: np.ndarray) -> None:
        """The leader's prompt is computed: `choice` takes a copy of its KV and samples its first
        token from the leader's last prompt row, as if it had prefilled the prompt itself."""
        self.runner.copy_prefix(leader.slot, choice.slot, leader.n_past)
        choice.follows, choice.n_past = None, leader.n_past
        choice.t_prefill = leader.t_prefill
        self._sample(choice, row)

    # -- tokens out ----------------------------------------------------------------------
    def _sample(self, act: Active, row: np.ndarray) -> None:
        if not act.out:
            act.prompt_ms = 1000.0 * (time.perf_counter() - act.t_prefill)
        tok = act.output.sample(row)
        if act.spec is not None:
            act.spec.index.extend((tok,))
        if not act.output.is_eog(tok):
            self.tokens_generated += 1
        delta = act.output.accept(tok, row)
        if delta is not None:
            if act.req.timings_per_token:
                delta = dataclasses.replace(delta, timings=act.timings(self.n_ctx, self.spec.label(act.spec)))
            self.emit(delta)

    def _take_rows(self, act: Active, span: Span, rows: np.ndarray) -> None:
        """A decode span's rows, sampled in order exactly as serial steps would sample them,
        up to the first token that is not the draft's next (or the end of the request); the
        KV past what was committed is dropped."""
        draft = act.spec.draft if act.spec is not None else ()
        used = 0
        for i, row in enumerate(rows):
            self._sample(act, row)
            used = i + 1
            if i == len(draft) or act.out[-1] != draft[i] or act.output.finished() is not None:
                break
        act.n_past = span.start_pos + used
        act.decode_tokens += used
        if used < len(span.tokens):
            self.runner.truncate(act.slot, act.n_past)
        if draft:
            self.spec.verified(act.spec, used, act.out[-used:])

    def _finish(self, act: Active, reason: str) -> None:
        if reason != "cancelled":
            reason, tail = act.output.finish(reason)
            if tail is not None:
                self.emit(tail)
        if act.slot >= 0 and self.slots[act.slot] is act:
            self.slots[act.slot], self.last[act.slot] = None, act
            self.cache.release(act.slot, act.prompt, act.n_past, pin=act.req.cache_pin and reason != "cancelled",
                               output=act.out, exact=act.cache_exact, settle=reason != "cancelled")
        if act.group is not None and not act.group.end(act, reason):
            return   # other choices of the request are still running
        lead = act.members[0]
        self.by_id.pop(lead.req.id, None)
        experts = self._expert_counts(lead.slot) if lead.slot >= 0 else None
        done = Done(lead.req.id, reason, lead.usage(), lead.timings(self.n_ctx, self.spec.label(lead.spec), experts),
                    lead.output.stop_string, lead.output.reply)
        self.emit(act.group.done(done) if act.group is not None else done)
