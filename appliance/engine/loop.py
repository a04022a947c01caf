"""The engine process's main loop: commands in, one scheduler step, events out.

Commands (`ipc`) are polled without blocking while there is work and with a short timeout when
idle. A submit is prepared (template, tokens, parsers: `prompts.PromptBuilder`) and queued;
/tokenize and /detokenize are answered as soon as they are read, between steps, and so are
llama-server's slot commands (slot_commands.py: an action on a busy slot waits for its request
to end). An embed is queued in the `Embedder` (embed.py), which runs one batch per turn before
the scheduler's step.
Each turn's events go to the server in one `StepEvents`, with the engine's statistics about
ten times a second; a stream's later tokens may wait for a later turn, at most
`stream_interval_ms` after the last message (`_hold`: each message wakes the server, its SSE
writer and the client, time taken from the compute threads on a small machine). A step takes the cores in turn with the pool's other engines (cores.py).
Idle for SETTLE_AFTER_S, and with nothing else computing, the prompt cache first settles the
replies that ended (one piece per turn, commands read between pieces: `PromptCache.settle_one`),
then saves one slot's state per tick for its disk writer thread; at Stop it hands over every
idle slot and waits, bounded, for the writes.
When the runner can move to faster kernels (a torch runner's first build of its CPU kernels
done), nobody new is admitted until no request holds a slot; the engine then moves
(`startup.upgrade`) and sends the server a second `Ready` with the new settings.
An embedding model's engine has no scheduler: it embeds, tokenizes and refuses the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import select
import time
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..errors import ApplianceError, EngineFailure, InvalidRequest
from .ipc import (Abort, Command, Detokenize, Embed, GetSlots, Ready, RenderPrompt, SlotAction, StepEvents, Stop,
                  Submit, Tokenize)
from .cores import Neighbours, Turns
from .embed import Embedder
from .sched.scheduler import Scheduler
from .slot_commands import SlotCommands
from .startup import start, start_embedding, upgrade, upgrade_ready
from .stats import EngineStats
from .types import Delta, Done, Error, Event, Request, Tokenized

log = logging.getLogger("appliance.engine")

STATS_INTERVAL_S = 0.1
IDLE_PERSIST_S = 1.0   # idle this long, the engine hands kept prompt states to the disk tier
# idle this long, the engine settles ended replies: a client sending turns back to back has sent
# the next one by then (bench's agent replay: a few ms), and would otherwise wait for a piece
SETTLE_AFTER_S = 0.05
IDLE_RETRY_S = 0.05    # idle work put off (something else computes): looked at again after this


class EngineLoop:
    def __init__(self, cfg: EngineConfig, embedding_only: bool = False, turns: str | None = None) -> None:
        self.outbox: list[Event] = []
        self.cfg = cfg
        self.turns, self.neighbours = Turns(turns), Neighbours()   # sharing the cores (cores.py)
        self._idle_retry_at = 0.0
        self._sent_at, self._streaming = 0.0, set()   # the last message's time; requests whose first token went
        self.engine = (start_embedding if embedding_only else start)(cfg, self.outbox.append)
        self.info, self.runner = self.engine.info, self.engine.runner
        self.scheduler, self.prompts = self.engine.scheduler, self.engine.prompts
        self.embedder = self.engine.embedder
        # what runs a batch per turn, embeddings first: each has has_work, step, abort, fail_all
        self.workers = [w for w in (self.embedder, self.scheduler) if w is not None]
        self.slot_commands = (SlotCommands(self.scheduler, cfg.slot_save_path, self._failed)
                              if self.scheduler is not None else None)

    def stats(self) -> EngineStats:
        return self.scheduler.stats() if self.scheduler is not None else EngineStats()

    # -- commands ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        try:
            if self.scheduler is None:
                raise InvalidRequest(f"the model {self.info.model_name} is an embedding model: it answers "
                                     "embeddings, not chat or completions", param="model")
            if req.images:   # placeholder ids are no tokens to look up or draft from
                req = dataclasses.replace(req, speculate="off")
            got = self.prompts.prepare(req)
            self.scheduler.submit(req, got.ids, got.matcher, got.parser, got.more)
        except Exception as e:
            self.outbox.append(self._failed(req.id, e))

    def embed(self, msg: Embed) -> None:
        if self.embedder is None:
            e = InvalidRequest(f"the model {self.info.model_name} does not answer embeddings; start the server with "
                               "--embedding-model chat to embed with it", param="model")
            self.outbox.append(Error(msg.request_id, *e.to_wire()))
        else:
            self.embedder.submit(msg)

    def tokens(self, msg: Tokenize | Detokenize | RenderPrompt) -> Event:
        """The one event answering a Tokenize, Detokenize or RenderPrompt command."""
        runner = self.runner
        try:
            match msg:
                case Tokenize(rid, text, add_special, parse_special, with_pieces):
                    ids = runner.tokenize(text, add_special, parse_special)
                    pieces = tuple(runner.detokenize([t]) for t in ids) if with_pieces else ()
                    return Tokenized(rid, tuple(ids), pieces)
                case Detokenize(rid, ids):
                    self.prompts.check_ids(ids, "tokens")
                    return Tokenized(rid, tuple(ids), text=runner.detokenize(ids).decode(errors="replace"))
                case RenderPrompt(rid, req):
                    ids, text = self.prompts.prompt_ids(req)
                    return Tokenized(rid, tuple(ids), text=text)
        except Exception as e:
            return self._failed(msg.request_id, e)

    def slots(self, msg: GetSlots | SlotAction) -> Event | None:
        """The answer to a slots command (slot_commands.py); None for an action whose slot is busy."""
        if self.slot_commands is None:
            e = InvalidRequest(f"the model {self.info.model_name} is an embedding model: it has no slots", param="model")
            return Error(msg.request_id, *e.to_wire())
        if isinstance(msg, GetSlots):
            return self.slot_commands.slots(msg)
        return self.slot_commands.act(msg)

    def _failed(self, request_id: str, e: Exception) -> Error:
        """The Error event for a request that could not be served: a bug fails it, not the engine."""
        if isinstance(e, ApplianceError):
            return Error(request_id, *e.to_wire())
        log.exception("request %s failed", request_id)
        return Error(request_id, *EngineFailure(f"internal engine error: {type(e).__name__}").to_wire())

    def handle(self, msg: Command, evt: Connection) -> bool:
        """Carry out one command; False when the loop must end (stopped, or the server is gone)."""
        match msg:
            case Submit(req):
                self.submit(req)
            case Abort(rid):
                for w in self.workers:
                    w.abort(rid)
                if self.slot_commands is not None:
                    self.slot_commands.abort(rid)
            case Embed():
                self.embed(msg)
            case Tokenize() | Detokenize() | RenderPrompt():
                self.outbox.append(self.tokens(msg))
                return self._send(evt, None)  # answered now, not after the next step
            case GetSlots() | SlotAction():
                answer = self.slots(msg)
                if answer is not None:       # None: an action waiting for its slot (answered by `due`)
                    self.outbox.append(answer)
                    return self._send(evt, None)
            case Stop():
                if self.scheduler is not None:
                    self.scheduler.cache.persist()
                self.close()
                return False
            case _:
                raise TypeError(f"unknown engine command {msg!r}")
        return True

    # -- loop ----------------------------------------------------------------------------
    def run(self, cmd: Connection, evt: Connection) -> None:
        last_stats = 0.0
        busy_at = time.monotonic()
        # one poll object for the loop's life: Connection.poll builds a selector on every call
        # (3.3 us a call here against 0.5; small beside a step, but paid every step)
        waiting = select.poll()
        waiting.register(cmd.fileno(), select.POLLIN)
        while True:
            timeout = self._poll_timeout(busy_at)
            while waiting.poll(timeout * 1000.0):
                timeout, busy_at = 0.0, time.monotonic()
                try:
                    msg = cmd.recv()
                except EOFError:
                    return  # the server is gone
                if not self.handle(msg, evt):
                    return
            if not self._upgrade(evt):
                return
            if self.has_work():
                for w in self.workers:
                    if w.has_work():
                        with self.turns.turn():        # the cores, in turn with the pool's other engines
                            self._step(w)
                busy_at = time.monotonic()
                if self.slot_commands is not None:   # slot actions that waited for a request to end
                    self.outbox.extend(self.slot_commands.due())
            else:
                self._idle_work(busy_at)
            now = time.monotonic()
            # and with a request's end: /health then shows what the release left to do idle
            stats_due = now - last_stats > STATS_INTERVAL_S or any(isinstance(e, (Done, Error)) for e in self.outbox)
            if self._due(now, stats_due):
                if not self._send(evt, self.stats() if stats_due else None):
                    return
                last_stats = now if stats_due else last_stats

    def _idle_work(self, busy_at: float) -> None:
        """One piece of idle work, when there is some due and nothing else computes (cores.py):
        settling an ended reply (one piece: a request arriving waits for no more), else, idle
        longer, write-behind (one slot's state per tick, so a request that arrives meanwhile
        waits for at most one save, the file written by the disk tier's thread, and a restart
        finds the conversations). Beside other work it waits IDLE_RETRY_S and looks again."""
        now = time.monotonic()
        settle = self._settling() and now - busy_at >= SETTLE_AFTER_S
        persist = not self._settling() and self.scheduler is not None and now - busy_at > IDLE_PERSIST_S
        if not (settle or persist) or now < self._idle_retry_at:
            return
        if self.neighbours.busy():
            self._idle_retry_at = now + IDLE_RETRY_S
            return
        with self.turns.idle_turn() as mine:
            if not mine:
                self._idle_retry_at = now + IDLE_RETRY_S
            elif settle:
                self.scheduler.cache.settle_one()
            else:
                self.scheduler.cache.persist_one()

    def _upgrade(self, evt: Connection) -> bool:
        """Once the runner can move to faster kernels (`startup.upgrade`): admit nobody new, and
        move as soon as no request holds a slot; the server gets the new info in a second Ready.
        False when the server is gone."""
        if self.scheduler is None or not upgrade_ready(self.engine):
            return True
        self.scheduler.holding = True
        if self.scheduler.running() or not upgrade(self.engine, self.cfg):
            return True
        self.info = self.engine.info
        try:
            evt.send(Ready(self.info, self.stats()))
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.engine.close()
        self.turns.close()

    def _hold(self, now: float) -> bool:
        """Whether this turn's events may wait for a later turn: only later tokens of streams
        (a request's first token goes at once, and its end, an error or an answer), while the
        engine keeps stepping, within stream_interval_ms of the last message. On 2 cores at depth
        512 the client's decode rate was 2.2% below the engine's with 40 ms, 4.9% with a message
        every step (performance.md, "Sharing the cores")."""
        interval = self.cfg.stream_interval_ms / 1000.0
        if not interval or now - self._sent_at >= interval or not self.has_work():
            return False
        return all(isinstance(e, Delta) and e.request_id in self._streaming for e in self.outbox)

    def _due(self, now: float, stats_due: bool) -> bool:
        """Whether a message goes now: events or stats to send, and no stream's tokens held.
        Stats due while tokens are held go with them, at most stream_interval_ms later: a message
        of their own (every 100 ms) woke the server, its writer and the client as often, a third
        of the messages of a stream at depth 512 here."""
        return bool(self.outbox or stats_due) and not (self.outbox and self._hold(now))

    def _send(self, evt: Connection, stats: EngineStats | None) -> bool:
        """Send the outbox (and stats); False when the server is gone."""
        for e in self.outbox:
            if isinstance(e, (Done, Error, Tokenized)) and self.prompts is not None:
                self.prompts.release(e.request_id)     # a request's pictures are held until its end
        try:
            evt.send(StepEvents(tuple(self.outbox), stats))
        except OSError:
            return False
        for e in self.outbox:
            if isinstance(e, Delta):
                self._streaming.add(e.request_id)
            elif isinstance(e, (Done, Error)):
                self._streaming.discard(e.request_id)
        self._sent_at = time.monotonic()
        self.outbox.clear()
        return True

    def has_work(self) -> bool:
        return any(w.has_work() for w in self.workers)

    def _settling(self) -> bool:
        return self.scheduler is not None and self.scheduler.cache.settling

    def _poll_timeout(self, busy_at: float) -> float:
        """How long to wait for a command: not at all with work, until settling may start with
        a reply to settle, else a quarter second."""
        if self.has_work():
            return 0.0
        if self._settling():
            return max(0.0, busy_at + SETTLE_AFTER_S - time.monotonic(), self._idle_retry_at - time.monotonic())
        return 0.25

    def _step(self, worker: Embedder | Scheduler) -> None:
        try:
            worker.step()
        except ApplianceError as e:
            log.error("step failed: %s", e.message)
            worker.fail_all(e)
        except Exception as e:  # a bug must fail the requests, not hang them
            log.exception("step failed")
            worker.fail_all(EngineFailure(f"internal engine error: {type(e).__name__}"))
