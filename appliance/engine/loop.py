"""The engine process's main loop: commands in, one scheduler step, events out.

Commands (`ipc`) are polled without blocking while there is work and with a short timeout when
idle. A submit is prepared (template, tokens, parsers: `prompts.PromptBuilder`) and queued;
/tokenize and /detokenize are answered as soon as they are read, between steps. Each step's
events go to the server in one `StepEvents`, with the engine's statistics about ten times a
second. While idle, the prompt cache writes one slot's state to disk per tick.
"""
from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..errors import ApplianceError, EngineFailure
from .ipc import Abort, Command, Detokenize, RenderPrompt, StepEvents, Stop, Submit, Tokenize
from .startup import start
from .stats import EngineStats
from .types import Error, Event, Request, Tokenized

log = logging.getLogger("appliance.engine")

STATS_INTERVAL_S = 0.1
IDLE_PERSIST_S = 1.0   # idle this long, the engine writes kept prompt states to the disk tier


class EngineLoop:
    def __init__(self, cfg: EngineConfig) -> None:
        self.outbox: list[Event] = []
        self.engine = start(cfg, self.outbox.append)
        self.info, self.runner = self.engine.info, self.engine.runner
        self.scheduler, self.prompts = self.engine.scheduler, self.engine.prompts

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # -- commands ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        try:
            got = self.prompts.prepare(req)
            self.scheduler.submit(req, got.ids, got.matcher, got.parser)
        except Exception as e:
            self.outbox.append(self._failed(req.id, e))

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
                self.scheduler.abort(rid)
            case Tokenize() | Detokenize() | RenderPrompt():
                self.outbox.append(self.tokens(msg))
                return self._send(evt, None)  # answered now, not after the next step
            case Stop():
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
        while True:
            timeout = 0.0 if self.scheduler.has_work() else 0.25
            while cmd.poll(timeout):
                timeout, busy_at = 0.0, time.monotonic()
                try:
                    msg = cmd.recv()
                except EOFError:
                    return  # the server is gone
                if not self.handle(msg, evt):
                    return
            if self.scheduler.has_work():
                self._step()
                busy_at = time.monotonic()
            elif time.monotonic() - busy_at > IDLE_PERSIST_S:
                # write-behind: one slot's state per idle tick, so a request that arrives
                # meanwhile waits for at most one write, and a restart finds the conversations
                self.scheduler.cache.persist_one()
            now = time.monotonic()
            stats_due = now - last_stats > STATS_INTERVAL_S
            if self.outbox or stats_due:
                if not self._send(evt, self.stats() if stats_due else None):
                    return
                last_stats = now if stats_due else last_stats

    def close(self) -> None:
        self.engine.close()

    def _send(self, evt: Connection, stats: EngineStats | None) -> bool:
        """Send the outbox (and stats); False when the server is gone."""
        try:
            evt.send(StepEvents(tuple(self.outbox), stats))
        except OSError:
            return False
        self.outbox.clear()
        return True

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except ApplianceError as e:
            log.error("step failed: %s", e.message)
            self.scheduler.fail_all(e)
        except Exception as e:  # a bug must fail the requests, not hang them
            log.exception("step failed")
            self.scheduler.fail_all(EngineFailure(f"internal engine error: {type(e).__name__}"))
