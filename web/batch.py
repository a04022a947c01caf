"""Several prompts in one completions request (a batch: prompts.py) answered as one request.

Each prompt is an engine request of its own, all submitted at once onto one event queue that
`Merged` reads as the stream of a single request, so the serving core (collect, stream, each
API's writer) answers a batch as it answers one request with n choices:

- choice j of prompt i is index i * n + j (OpenAI's numbering for several prompts with n > 1);
- the batch's Accepted comes once every prompt is accepted; a prompt refused (over the context,
  a token id outside the vocabulary, a full queue) refuses the batch with its error, the message
  naming the prompt, and the others are aborted: a 4xx before any stream byte, as for one prompt;
- its Done comes once every prompt is done: usage summed (each prompt counted once, as OpenAI
  counts a batch), every choice's end, timings' counts summed and their times the longest
  prompt's. `parts` keeps each prompt's own Accepted and Done (llama-server answers a result per
  prompt).
"""
from __future__ import annotations

import dataclasses
import queue
import time
from collections import deque
from typing import Sequence

from appliance.engine.process import EngineClient, RequestStream
from appliance.engine.types import Accepted, ChoiceEnd, Delta, Done, Error, Event, Request, Timings, Usage
from appliance.errors import ApplianceError, from_wire


class Merged:
    """The events of a batch's requests as one request's (RequestStream's interface)."""

    def __init__(self, request_id: str, n: int, requests: Sequence[Request]) -> None:
        self.id, self.n = request_id, n
        self.events: queue.Queue[Event] = queue.Queue()
        self.index = {r.id: i for i, r in enumerate(requests)}    # request id -> its prompt
        self.streams: list[RequestStream] = []
        self.accepted: list[Accepted | None] = [None] * len(requests)
        self.parts: list[Done | None] = [None] * len(requests)
        self.early: deque[Delta] = deque()   # tokens that came before every prompt was accepted
        self.open = False                    # the batch's Accepted was handed out

    @classmethod
    def submit(cls, engine: EngineClient, batch: Sequence[Request], request_id: str, n: int) -> Merged:
        merged = cls(request_id, n, batch)
        try:
            for req in batch:
                merged.streams.append(engine.submit(req, merged.events))
        except BaseException:
            merged.abort()
            raise
        return merged

    def get(self, timeout: float | None = None) -> Event | None:
        """The batch's next event, or None when `timeout` passes first; a prompt's error raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.open and self.early:
                return self.early.popleft()
            try:
                ev = self.events.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            out = self._merge(ev)
            if out is not None:
                return out

    def get_nowait(self) -> Event | None:
        return self.get(timeout=0)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()      # a no-op for a prompt already done

    def _merge(self, ev: Event) -> Event | None:
        """What one prompt's event makes of the batch's: an event, or None (nothing yet)."""
        i = self.index[ev.request_id]
        if isinstance(ev, Error):
            self.streams[i].finished = True
            self.abort()
            raise _naming(from_wire(ev.kind, ev.message, ev.fields), i)
        if isinstance(ev, Accepted):
            self.accepted[i] = ev
            if not all(self.accepted):
                return None
            self.open = True
            return Accepted(self.id, sum(a.n_prompt_tokens for a in self.accepted),
                            sum(a.n_cached for a in self.accepted))
        if isinstance(ev, Delta):
            delta = dataclasses.replace(ev, request_id=self.id, index=i * self.n + ev.index)
            if self.open:
                return delta
            self.early.append(delta)
            return None
        assert isinstance(ev, Done), ev
        self.parts[i] = ev
        self.streams[i].finished = True
        return self._done() if all(self.parts) else None

    def _done(self) -> Done:
        parts = self.parts
        ends = tuple(ChoiceEnd(i * self.n + e.index, e.finish_reason, e.stop_string, e.token_ids)
                     for i, done in enumerate(parts) for e in done.ends())
        usage = Usage(sum(d.usage.prompt_tokens for d in parts), sum(d.usage.completion_tokens for d in parts),
                      sum(d.usage.cached_tokens for d in parts))
        first = parts[0]
        return Done(self.id, first.finish_reason, usage, merged_timings([d.timings for d in parts]),
                    first.stop_string, first.token_ids, ends)


def merged_timings(each: Sequence[Timings]) -> Timings:
    """A batch's timings: the prompts' counts summed, their times the longest prompt's (they run
    side by side), so the rates are the batch's."""
    def total(name: str) -> int:
        return sum(getattr(t, name) for t in each)

    def longest(name: str) -> float:
        return max(getattr(t, name) for t in each)

    reuse = "inexact" if any(t.cache_reuse == "inexact" for t in each) else each[0].cache_reuse
    return dataclasses.replace(each[0], prompt_n=total("prompt_n"), cache_n=total("cache_n"),
                               predicted_n=total("predicted_n"), draft_n=total("draft_n"),
                               draft_n_accepted=total("draft_n_accepted"), prompt_ms=longest("prompt_ms"),
                               predicted_ms=longest("predicted_ms"), queue_ms=longest("queue_ms"), cache_reuse=reuse)


def _naming(e: ApplianceError, i: int) -> ApplianceError:
    """A prompt's error as the batch's: its message names the prompt (and so does its param, a
    client's mistake about the prompt itself)."""
    param = f"prompt[{i}]" if e.status == 400 and e.param in (None, "prompt") else e.param
    return type(e)(f"prompt[{i}]: {e.message}", param=param, **e.fields)
