"""The scheduler: slots, admission, continuous batching, cancellation, the context limit.

Design
------
The runner holds `n_slots` sequences. A request is validated at submit (its prompt plus its
`max_tokens` must fit one slot's `n_ctx`, else `ContextOverflow` before any work) and waits in
a bounded FIFO queue; past `max_queue` it is refused with `QueueFull`.

Each `step()` is one iteration of continuous batching:
  1. cancelled requests leave (queue or slot) -- so an abort takes effect within one step;
  2. waiting requests take free slots (their KV truncated to empty);
  3. every decoding request contributes one token (its last sample) to the batch;
  4. prefilling requests, oldest first, contribute one prompt chunk each while the step's
     prompt-token budget lasts. Chunks are aligned to a fixed grid of absolute positions
     (`prefill_chunk`), so a prompt is always cut at the same places whatever else runs: its KV,
     and so its output, does not depend on the other requests;
  5. one `runner.forward` over all of that, then sampling for every row that was asked for.
A long prompt therefore never holds other streams for more than one chunk per step, and a new
request joins the running batch at the next step.

Prompt cache, slot tier: when a request ends, its slot keeps the prompt's KV for the whole
grid blocks it covers (`kept`). A new request takes the free slot whose kept blocks share the
longest prefix with its prompt, keeps those blocks, and prefills the rest in the same grid
chunks a cold run would use, so a hit gives exactly the cold answer. Positions computed by
one-token decode steps (a previous reply) are never reused: a cold run would compute them in
a chunk, with other numerics.

Invariant: a request in a slot has exactly `n_past` positions in that slot's KV.
"""
from __future__ import annotations

import codecs
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import EngineConfig
from ..errors import ApplianceError, ContextOverflow, InvalidRequest, QueueFull
from .constraints import Matcher
from .output import OutputParser, Piece
from .prefix_cache import DiskTier, PrefillCost, RamTier
from .slot_cache import SlotCache
from . import speculate as spec
from .draft import DraftModel
from .runners.base import ModelRunner, Span
from .sampling import Sampler, StopMatcher, log_softmax, top_ids
from .types import (Accepted, Delta, Done, Error, Event, Request, Timings, TokenLogprob, TopLogprob,
                    Usage)

log = logging.getLogger("appliance.scheduler")


@dataclass
class Active:
    """A request from admission to its last event."""

    req: Request
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop: StopMatcher
    utf8: codecs.IncrementalDecoder
    t_submit: float
    slot: int = -1
    n_past: int = 0                  # positions of this request in its slot's KV
    out: list[int] = field(default_factory=list)
    cancelled: bool = False
    stopped: bool = False            # a stop string ended the output
    matcher: Matcher | None = None   # structured output: the grammar's state
    parser: OutputParser | None = None  # chat: reasoning and tool calls apart from content
    t_admit: float = 0.0
    t_prefill: float = 0.0           # start of the first prefill chunk
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0
    cached: int = 0                  # prompt positions reused from the slot's kept blocks
    decode_tokens: int = 0           # tokens committed by decode steps (several per verify)
    spec: spec.Drafting | None = None  # prompt lookup, when this request drafts

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.prompt)


@dataclass(frozen=True)
class StepStats:
    decode_rows: int
    prefill_tokens: int
    ms: float


class Scheduler(SlotCache):
    def __init__(self, runner: ModelRunner, cfg: EngineConfig, emit: Callable[[Event], None],
                 disk: DiskTier | None = None, policy: spec.Policy | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.runner = runner
        self.drafter = drafter
        self.policy = policy or spec.Policy()
        self.spec_stats = spec.SpecStats()
        self.cfg = cfg
        self.emit = emit
        self.n_ctx = runner.info.n_ctx
        self.waiting: deque[Active] = deque()
        self.slots: list[Active | None] = [None] * runner.info.n_slots
        self.kept: list[list[int]] = [[] for _ in self.slots]  # reusable prompt blocks per slot
        self.on_disk: list[bool] = [False for _ in self.slots]  # kept blocks already checked/written
        self.cache_hit_tokens = 0
        self.prefill_cost = PrefillCost()
        self.ram = RamTier(cfg.cache_ram_bytes, cfg.prefill_chunk, self.prefill_cost) \
            if cfg.prompt_cache and cfg.cache_ram_bytes > 0 else None
        self.disk = disk if cfg.prompt_cache else None
        if self.disk is not None:
            self.disk.cost = self.prefill_cost  # disk eviction values entries by the same measured rates
        self.by_id: dict[str, Active] = {}
        self.steps = 0
        self.decode_rows_seen: Counter[int] = Counter()
        self.tokens_generated = 0

    # -- requests in ---------------------------------------------------------------------
    def submit(self, req: Request, prompt: list[int], matcher: Matcher | None = None,
               parser: OutputParser | None = None) -> None:
        """Validate and queue; emits Accepted, or Error and nothing else."""
        try:
            act = self._admit_check(req, prompt)
            act.matcher, act.parser = matcher, parser
        except ApplianceError as e:
            kind, message, fields = e.to_wire()
            self.emit(Error(req.id, kind, message, fields))
            return
        self.waiting.append(act)
        self.by_id[req.id] = act
        self.emit(Accepted(req.id, len(prompt), 0))

    def _admit_check(self, req: Request, prompt: list[int]) -> Active:
        n = len(prompt)
        if n == 0:
            raise ContextOverflow("the prompt is empty after tokenization", n_prompt_tokens=0,
                                  n_ctx=self.n_ctx)
        p = req.params
        max_tokens = p.max_tokens or self.cfg.max_tokens_default or (self.n_ctx - n)
        if n + max_tokens > self.n_ctx or max_tokens < 1:
            raise ContextOverflow(
                f"this request needs {n} prompt tokens + {max_tokens} max_tokens, more than the "
                f"context of {self.n_ctx} tokens per slot",
                param="messages" if req.messages is not None else "prompt",
                n_prompt_tokens=n, n_ctx=self.n_ctx, max_tokens=max_tokens)
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests "
                            "are waiting; retry later", retry_after=1)
        # any integer is a seed (OpenAI allows negatives); PCG64 takes non-negative ones
        seed = p.seed % 2**64 if p.seed is not None else int.from_bytes(os.urandom(8), "little")
        mode = req.speculate or self.policy.default
        refused = self.policy.refusal(mode)
        if refused:
            raise InvalidRequest(f"speculate: {refused}", param="speculate")
        drafting = None
        if mode != "off":
            prior = self.policy.draft.prior if mode == "draft" and self.policy.draft else spec.PRIOR_ACCEPT
            drafting = spec.Drafting(spec.NgramIndex(prompt), mode, spec.Acceptance(prior=prior))
        return Active(req=req, prompt=list(prompt), max_tokens=max_tokens, sampler=Sampler(p, seed),
                      stop=StopMatcher(p.stop), t_submit=time.perf_counter(),
                      utf8=codecs.getincrementaldecoder("utf-8")(errors="replace"),
                      spec=drafting)

    def abort(self, request_id: str) -> None:
        act = self.by_id.get(request_id)
        if act is not None:
            act.cancelled = True

    def fail_all(self, err: ApplianceError) -> None:
        """End every request with `err` (the runner failed under them); the slots are emptied."""
        for act in list(self.waiting) + [a for a in self.slots if a is not None]:
            self.emit(Error(act.req.id, *err.to_wire()))
            self.by_id.pop(act.req.id, None)
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        self.kept = [[] for _ in self.slots]  # the runner failed: trust no KV
        if self.drafter is not None:
            try:
                self.drafter.reset()
            except Exception:  # the draft model may be what failed
                log.exception("resetting the draft model failed")

    # -- state ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def stats(self) -> dict:
        return {
            "steps": self.steps, "slots_busy": sum(s is not None for s in self.slots),
            "n_slots": len(self.slots), "queue_depth": len(self.waiting),
            "tokens_generated": self.tokens_generated,
            "max_decode_batch": max(self.decode_rows_seen, default=0),
            "kv_tokens": sum(a.n_past for a in self.slots if a is not None),
            "cache_hit_tokens": self.cache_hit_tokens,
            "cached_tokens": sum(len(k) for k in self.kept),
            **(self.ram.stats() if self.ram is not None else {}),
            **(self.disk.stats() if self.disk is not None else {}),
            "kv_capacity": len(self.slots) * self.n_ctx,
            "decode_batches": {str(k): v for k, v in sorted(self.decode_rows_seen.items())},
            **self.spec_stats.as_dict(),
        }

    # -- one iteration -------------------------------------------------------------------
    def step(self) -> StepStats:
        self._drop_cancelled()
        self._fill_slots()
        t0 = time.perf_counter()  # the draft model's forwards are part of the step
        spans, owners = self._plan()
        if not spans:
            return StepStats(0, 0, 0.0)
        decoding = [not a.prefilling for a in owners]
        for act in owners:
            if not act.t_prefill:
                act.t_prefill = t0
        t_fwd = time.perf_counter()
        logits = self.runner.forward(spans)
        if self.drafter is not None:
            if all(decoding):  # a clean measure of the draft model's cost against the target's
                self.drafter.observe(time.perf_counter() - t_fwd, self.policy.cost(sum(len(s.tokens) for s in spans)))
            self.drafter.last = None
            # the draft model prefills along with the target
            self.drafter.follow([(a.slot, a.prompt[:s.start_pos + len(s.tokens)]) for a, s, dec
                                 in zip(owners, spans, decoding) if not dec and a.spec and a.spec.mode == "draft"])
        sampled = []
        for act, span, lg, dec in zip(owners, spans, logits, decoding):
            if dec:
                self._take_rows(act, span, lg)
            else:
                act.n_past += len(span.tokens)
                if span.n_logits:
                    self._on_logits(act, lg[-1])
            if span.n_logits:
                sampled.append(act)
        ms = 1000.0 * (time.perf_counter() - t0)
        for act, dec in zip(owners, decoding):
            if dec:
                act.decode_ms += ms
                act.decode_steps += 1
        for act in sampled:
            reason = self._finished(act)
            if reason is not None:
                self._finish(act, reason)
        n_decode = sum(decoding)
        prefills = [s for s, dec in zip(spans, decoding) if not dec]
        if len(prefills) == 1 and not n_decode:  # a clean measurement of one chunk at its depth
            self.prefill_cost.observe(prefills[0].start_pos, len(prefills[0].tokens), ms)
        self.steps += 1
        if n_decode:
            self.decode_rows_seen[n_decode] += 1
        n_prefill = sum(len(s.tokens) for s, dec in zip(spans, decoding) if not dec)
        return StepStats(n_decode, n_prefill, ms)

    def _drop_cancelled(self) -> None:
        for act in [a for a in self.waiting if a.cancelled]:
            self.waiting.remove(act)
            self._finish(act, "cancelled")
        for act in self.slots:
            if act is not None and act.cancelled:
                self._finish(act, "cancelled")

    def _fill_slots(self) -> None:
        while self.waiting and None in self.slots:
            act = self.waiting.popleft()
            i, reuse = self._pick_slot(act)
            self._spill(i, reuse)
            reuse = self._restore_saved(act, i, reuse)
            self.runner.truncate(i, reuse)
            self.kept[i] = []  # the slot is being rewritten from position `reuse` on
            act.slot, act.n_past, act.cached, act.t_admit = i, reuse, reuse, time.perf_counter()
            self.cache_hit_tokens += reuse
            self.slots[i] = act

    def _plan(self) -> tuple[list[Span], list[Active]]:
        spans: list[Span] = []
        owners: list[Active] = []
        decoding = [a for a in self.slots if a is not None and not a.prefilling]
        room = [min(a.max_tokens - len(a.out), self.n_ctx - a.n_past - 1) - 1 for a in decoding]
        drafts = spec.drafts([a.spec for a in decoding], room, self.policy, self.drafter,
                             [a.slot for a in decoding]) if decoding else []
        for act, draft in zip(decoding, drafts):
            spans.append(Span(act.slot, (act.out[-1], *draft), act.n_past, 1 + len(draft)))
            owners.append(act)
        budget = self.cfg.step_token_budget
        chunk = self.cfg.prefill_chunk
        for act in sorted((a for a in self.slots if a is not None and a.prefilling),
                          key=lambda a: a.t_submit):
            end = min(len(act.prompt), (act.n_past // chunk + 1) * chunk)
            n = end - act.n_past
            if n > budget and budget < self.cfg.step_token_budget:
                break  # chunks are never split: the next step takes it whole
            last = end == len(act.prompt)
            spans.append(Span(act.slot, tuple(act.prompt[act.n_past:end]), act.n_past, 1 if last else 0))
            owners.append(act)
            budget -= n
            if budget <= 0:
                break
        return spans, owners

    # -- tokens out ----------------------------------------------------------------------
    def _on_logits(self, act: Active, row: np.ndarray) -> None:
        if not act.out:
            act.prompt_ms = 1000.0 * (time.perf_counter() - act.t_prefill)
        tok = act.sampler(row, act.matcher.allowed() if act.matcher else None)
        if act.matcher:
            act.matcher.accept(tok)
        act.out.append(tok)
        if act.spec is not None:
            act.spec.index.extend((tok,))
        if tok in self.runner.info.eog_ids and not act.req.params.ignore_eos:
            return
        self.tokens_generated += 1
        piece = self.runner.detokenize([tok])
        res = act.stop.feed(act.utf8.decode(piece))
        lps = (self._logprobs(row, tok, piece, act.req.params.top_logprobs),) if act.req.params.logprobs else ()
        got = act.parser.feed(res.text) if act.parser is not None else Piece(res.text)
        if got or lps:
            self.emit(Delta(act.req.id, got.content, (tok,), lps, got.calls, got.reasoning))
        act.stopped = res.stopped

    def _take_rows(self, act: Active, span: Span, rows: np.ndarray) -> None:
        """A decode span's rows, sampled in order exactly as serial steps would sample them,
        up to the first token that is not the draft's next (or the end of the request); the
        KV past what was committed is dropped."""
        draft = act.spec.draft if act.spec is not None else ()
        used = 0
        for i, row in enumerate(rows):
            self._on_logits(act, row)
            used = i + 1
            if i == len(draft) or act.out[-1] != draft[i] or self._finished(act) is not None:
                break
        act.n_past = span.start_pos + used
        act.decode_tokens += used
        if used < len(span.tokens):
            self.runner.truncate(act.slot, act.n_past)
        if draft:
            spec.record(act.spec, self.spec_stats, used, act.out[-used:])

    def _logprobs(self, row: np.ndarray, tok: int, piece: bytes, n_top: int) -> TokenLogprob:
        lp = log_softmax(row)

        def entry(t: int, raw: bytes) -> TopLogprob:
            return TopLogprob(raw.decode("utf-8", errors="replace"), tuple(raw), float(lp[t]))

        top = tuple(entry(int(t), self.runner.detokenize([int(t)])) for t in top_ids(lp, n_top))
        e = entry(tok, piece)
        return TokenLogprob(e.token, e.bytes, e.logprob, top)

    def _finished(self, act: Active) -> str | None:
        if act.stopped or (act.matcher is not None and act.matcher.done()):
            return "stop"
        last = act.out[-1]
        if last in self.runner.info.eog_ids and not act.req.params.ignore_eos:
            return "stop"
        if len(act.out) >= act.max_tokens or len(act.prompt) + len(act.out) >= self.n_ctx:
            return "length"
        return None

    def _finish(self, act: Active, reason: str) -> None:
        if reason != "cancelled":
            tail = "" if act.stopped else act.stop.flush() + act.utf8.decode(b"", final=True)
            got = Piece(tail)
            if act.parser is not None:
                a, b = act.parser.feed(tail), act.parser.flush()
                got = Piece(a.content + b.content, a.reasoning + b.reasoning, a.calls + b.calls)
                if act.parser.n_calls and reason == "stop":
                    reason = "tool_calls"
            if got:
                self.emit(Delta(act.req.id, got.content, (), (), got.calls, got.reasoning))
        if act.slot >= 0 and self.slots[act.slot] is act:
            self.slots[act.slot] = None
            chunk = self.cfg.prefill_chunk
            self.kept[act.slot] = act.prompt[: min(act.n_past, len(act.prompt)) // chunk * chunk]
            self.on_disk[act.slot] = False
            if act.req.cache_pin and reason != "cancelled":
                self._pin(act.slot)
        self.by_id.pop(act.req.id, None)
        n_out = sum(1 for t in act.out if t not in self.runner.info.eog_ids or act.req.params.ignore_eos)
        usage = Usage(len(act.prompt), n_out, act.cached)
        queue_ms = 1000.0 * ((act.t_admit or time.perf_counter()) - act.t_submit)
        drafted, accepted = act.spec.totals() if act.spec is not None else (0, 0)
        timings = Timings(prompt_n=len(act.prompt) - act.cached, cache_n=act.cached, prompt_ms=act.prompt_ms,
                          predicted_n=act.decode_tokens, predicted_ms=act.decode_ms,
                          queue_ms=queue_ms, n_ctx=self.n_ctx,
                          tokens_per_step=act.decode_tokens / act.decode_steps if act.decode_steps else 1.0,
                          draft_n=drafted, draft_n_accepted=accepted,
                          speculation=self.policy.label(act.spec.mode) if act.spec is not None else "off")
        self.emit(Done(act.req.id, reason, usage, timings))
