"""The engine process and its supervisor.

    server process                                   engine process (spawned)
    EngineClient.submit(Request) --- cmd pipe --->   engine_main: render template, tokenize,
    EngineClient.abort(id)           Submit, Abort,  Scheduler.step() over the runner
    EngineClient.tokenize/detokenize Tokenize, ...   answered between steps: one Tokenized
    EngineClient.slots/slot_action   GetSlots, ...   answered between steps: Slots, SlotDone
    EngineClient.embed(Embed)        Embed           batched, a batch per turn: one Embedded
    router thread  <------- event pipe ----------    Ready, then one StepEvents per step
      -> per-request queue.Queue

The messages are the frozen dataclasses of `ipc.py`.

The model lives only in the engine process, so a native crash (a malformed GGUF, a kernel bug)
kills that process and not the server. The supervisor thread notices the closed pipe, ends
every in-flight request with `EngineCrashed`, and starts a new engine; `state` says
"restarting" with the reason until the new one is ready.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence

from ..compute_settings import thread_env
from ..config import EngineConfig
from ..errors import ApplianceError, EngineCrashed, EngineUnavailable, from_wire
from .ipc import (Abort, Command, Detokenize, Embed, GetSlots, LoadFailed, Ready, RenderPrompt, SlotAction, StepEvents,
                  Stop, Submit, Tokenize)
from .runners.base import RunnerInfo
from .stats import EngineStats
from .types import Done, Embedded, Error, Event, Request, SlotDone, Slots, Tokenized

log = logging.getLogger("appliance.engine")

_TERMINAL = (Done, Error, Tokenized, Embedded, Slots, SlotDone)
ANSWER_TIMEOUT_S = 60.0  # a tokenize command waits for at most the scheduler step under way
# a slot action on a busy slot waits for its request to end (llama-server waits as long as the client)
SLOT_ACTION_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------
# engine side


def engine_main(cfg: EngineConfig, cmd: Connection, evt: Connection, log_level: str = "INFO",
                embedding_only: bool = False, turns: str | None = None) -> None:
    """Entry point of the engine process: load, then loop over commands and scheduler steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the engine stops
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    cfg = _thread_wait(cfg)
    os.environ.update(thread_env(cfg.thread_wait))  # before llama.cpp's or torch's OpenMP loads
    from .loop import EngineLoop  # heavy imports (llama_cpp, torch) happen only in this process

    try:
        loop = EngineLoop(cfg, embedding_only, turns)
    except ApplianceError as e:
        evt.send(LoadFailed(*e.to_wire()))
        return
    evt.send(Ready(loop.info, loop.stats()))
    loop.run(cmd, evt)


def _thread_wait(cfg: EngineConfig) -> EngineConfig:
    """cfg with `--thread-wait auto` resolved (engine_choice.thread_wait), said in the log."""
    if cfg.thread_wait != "auto":
        return cfg
    from ..engine_choice import thread_wait
    from ..models import resolve

    try:
        wait, why = thread_wait(cfg, resolve(cfg.model).path)
    except ApplianceError as e:   # the model is not there: the load says so, with the default wait
        wait, why = "spin", e.message
    log.info("threads wait: %s (%s)", wait, why)
    return dataclasses.replace(cfg, thread_wait=wait)


# ---------------------------------------------------------------------------------------------
# server side


@dataclass(frozen=True)
class EngineState:
    status: str            # starting | ready | restarting | failed | stopped
    reason: str
    pid: int | None
    restarts: int


class RequestStream:
    """Events of one request: Accepted first, then Deltas, then Done (an Error raises)."""

    def __init__(self, client: "EngineClient", request_id: str, events: queue.Queue | None = None) -> None:
        self.client = client
        self.id = request_id
        self.queue: queue.Queue[Event] = queue.Queue() if events is None else events
        self.finished = False

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` passes first. An Error event raises."""
        try:
            ev = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._seen(ev)

    def _seen(self, ev: Event) -> Event:
        if isinstance(ev, _TERMINAL):
            self.finished = True
        if isinstance(ev, Error):
            raise from_wire(ev.kind, ev.message, ev.fields)
        return ev

    def get_nowait(self) -> Event | None:
        """The next event if one is waiting, else None. An Error event raises."""
        try:
            ev = self.queue.get_nowait()
        except queue.Empty:
            return None
        return self._seen(ev)

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.id)


class EngineClient:
    """Owns the engine process: starts it, routes its events, restarts it when it dies."""

    def __init__(self, cfg: EngineConfig, log_level: str = "info", embedding_only: bool = False,
                 turns: str | None = None) -> None:
        self.cfg = cfg
        self.log_level = log_level
        self.embedding_only = embedding_only     # an embedding model's engine (engine/embed.py)
        self.turns = turns                       # the lock file of the cores it shares (cores.Turns)
        self.info: RunnerInfo | None = None
        self.lora: tuple[tuple[int, float], ...] | None = None   # POST /lora-adapters' scales (None: the flags')
        self.stats: EngineStats | None = None
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._cmd: Connection | None = None
        self._proc: Any = None
        self._state = EngineState("starting", "loading the model", None, 0)
        self._ready = threading.Event()
        self._closing = False
        self._ids = itertools.count()
        self._supervisor = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> "EngineClient":
        self._supervisor.start()
        if timeout is not None:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.1):
                return
            if self._state.status in ("failed", "stopped"):
                raise EngineUnavailable(self._state.reason)
        raise EngineUnavailable(f"the engine did not load within {timeout:.0f} s")

    @property
    def state(self) -> EngineState:
        return self._state

    def close(self, timeout: float = 60.0) -> None:
        """Stop the engine; it first writes idle slots' prompt states to disk, which may take a
        while for long contexts (most are written while idle already)."""
        self._closing = True
        self._send(Stop(), quiet=True)
        proc = self._proc
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._state = EngineState("stopped", "the server is shutting down", None, self._state.restarts)
        self._supervisor.join(timeout)

    # -- requests ------------------------------------------------------------------------
    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{time.time_ns():x}{next(self._ids):04x}"

    def submit(self, req: Request, events: queue.Queue | None = None) -> RequestStream:
        """`events`: a queue that several requests' events share (a batch's: web/batch.py reads
        it, each event naming its request), else the stream's own."""
        return self._open(req.id, Submit(req), events)

    def embed(self, msg: Embed) -> RequestStream:
        """Its events: one Embedded (or an Error). Like a request's stream, not a blocking ask: an
        embeddings request waits behind other batches, and a client that leaves aborts it."""
        return self._open(msg.request_id, msg)

    def tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool,
                 timeout: float = ANSWER_TIMEOUT_S) -> Tokenized:
        rid = self.new_id("tok")
        return self._ask(rid, Tokenize(rid, text, add_special, parse_special, with_pieces), timeout)

    def tokenize_many(self, texts: Sequence[tuple[str, bool, bool]],
                      timeout: float = ANSWER_TIMEOUT_S) -> list[tuple[int, ...]]:
        """Each (text, add_special, parse_special) tokenized on its own, all sent at once: the
        engine answers them in the same pause between two steps."""
        streams = []
        try:
            for text, add_special, parse_special in texts:
                rid = self.new_id("tok")
                streams.append(self._open(rid, Tokenize(rid, text, add_special, parse_special, False)))
            return [self._answer(s, timeout).ids for s in streams]
        finally:
            for s in streams:
                s.abort()

    def detokenize(self, ids: tuple[int, ...], timeout: float = ANSWER_TIMEOUT_S) -> Tokenized:
        rid = self.new_id("detok")
        return self._ask(rid, Detokenize(rid, ids), timeout)

    def render_prompt(self, req: Request, timeout: float = ANSWER_TIMEOUT_S) -> Tokenized:
        """The prompt `req` would be given: its ids and text (nothing is generated)."""
        rid = self.new_id("render")
        return self._ask(rid, RenderPrompt(rid, dataclasses.replace(req, id=rid)), timeout)

    def slots(self, timeout: float = ANSWER_TIMEOUT_S) -> Slots:
        """Every slot's state (llama-server's GET /slots)."""
        rid = self.new_id("slots")
        return self._ask(rid, GetSlots(rid), timeout)

    def slot_action(self, slot: int, action: str, filename: str = "",
                    timeout: float = SLOT_ACTION_TIMEOUT_S) -> SlotDone:
        """Save, restore or erase a slot (llama-server's POST /slots/ID); on a busy slot, once its
        request ends."""
        rid = self.new_id("slot")
        return self._ask(rid, SlotAction(rid, slot, action, filename), timeout)

    def _ask(self, request_id: str, msg: Command, timeout: float) -> Tokenized:
        """Send a command the engine answers with one event, and wait for it (an Error raises)."""
        return self._answer(self._open(request_id, msg), timeout)

    @staticmethod
    def _answer(stream: RequestStream, timeout: float) -> Tokenized:
        ev = stream.get(timeout)
        if ev is None:
            stream.abort()
            raise EngineUnavailable(f"the engine did not answer within {timeout:.0f} s")
        return ev

    def _open(self, request_id: str, msg: Command, events: queue.Queue | None = None) -> RequestStream:
        stream = RequestStream(self, request_id, events)
        with self._lock:
            if self._state.status != "ready":
                raise EngineUnavailable(f"the engine is {self._state.status}: {self._state.reason}")
            self._streams[request_id] = stream
        if not self._send(msg):
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineUnavailable("the engine process is not reachable; it is being restarted")
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(Abort(request_id), quiet=True)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def _send(self, msg: Command, quiet: bool = False) -> bool:
        with self._send_lock:
            if self._cmd is None:
                return False
            try:
                self._cmd.send(msg)
                return True
            except (OSError, ValueError):
                if not quiet:
                    log.warning("engine command pipe is closed")
                return False

    # -- supervision ---------------------------------------------------------------------
    def _supervise(self) -> None:
        backoff = 0.5
        while not self._closing:
            cmd_parent, cmd_child = self._ctx.Pipe(duplex=False)
            evt_parent, evt_child = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=engine_main, name="appliance-engine", daemon=True,
                                     args=(self.cfg, cmd_parent, evt_child, self.log_level, self.embedding_only,
                                           self.turns))
            proc.start()
            cmd_parent.close()
            evt_child.close()
            with self._send_lock:
                self._cmd, self._proc = cmd_child, proc
            self._state = EngineState(self._state.status, self._state.reason, proc.pid, self._state.restarts)
            was_ready, failure = self._route(evt_parent)
            proc.join(5)
            code = proc.exitcode
            with self._send_lock:
                self._cmd = None
            cmd_child.close()
            evt_parent.close()
            self._ready.clear()
            reason = failure or f"the engine process exited with code {code}"
            self._fail_in_flight(f"{reason} while this request was running; the engine is restarting")
            if self._closing:
                break
            if not was_ready:
                # it never loaded: restarting would fail the same way
                self._state = EngineState("failed", failure or f"the engine process died while loading "
                                          f"the model (exit code {code})", None, self._state.restarts)
                log.error("engine failed to start: %s", self._state.reason)
                return
            self._state = EngineState("restarting", reason, None, self._state.restarts + 1)
            log.error("%s; restarting the engine", reason)
            time.sleep(backoff)

    def _route(self, conn: Connection) -> tuple[bool, str | None]:
        """Read the engine's messages until its pipe closes. Returns (was ready, load failure)."""
        was_ready = False
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return was_ready, None
            match msg:
                case StepEvents(events, stats):
                    if stats is not None:   # first: a client that reads /health on an answer sees its effects
                        self.stats = stats
                    self._dispatch(events)
                case Ready(info, stats):
                    self.info, self.stats = info, stats
                    was_ready = True
                    self._state = EngineState("ready", "", self._state.pid, self._state.restarts)
                    self._ready.set()
                case LoadFailed(kind, message, fields):
                    return False, from_wire(kind, message, fields).message
                case _:
                    raise TypeError(f"unknown engine reply {msg!r}")

    def _dispatch(self, events: tuple[Event, ...]) -> None:
        with self._lock:
            for ev in events:
                stream = self._streams.get(ev.request_id)
                if stream is None:
                    continue  # aborted: nobody listens
                stream.queue.put(ev)
                if isinstance(ev, _TERMINAL):
                    del self._streams[ev.request_id]

    def _fail_in_flight(self, message: str) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            kind, msg, fields = EngineCrashed(message).to_wire()
            stream.queue.put(Error(stream.id, kind, msg, fields))
