"""A loaded model for the web app whose replies are scripted: the engine's own pieces in-process
(prompt builder, one scheduler with its prompt cache, output parser, grammar) over
tests/engine/scripted_runner.py (or its ReplayRunner over a real model), on a tiny GGUF that carries a real model's chat template and its
format's markers as special tokens. `ScriptedPool` serves it as the only model, so the whole app
(every dialect) answers with the script, through Flask's test client or, with `serve`, over a real
socket to clients in other processes (the coding agents' CLIs)."""
from __future__ import annotations

import contextlib
import queue
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

from appliance.config import Config, EngineConfig, ServerConfig
from appliance.engine.process import EngineState
from appliance.engine.prompts import PromptBuilder
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Done, Request, Tokenized
from tests.engine.chat_templates import cases
from tests.engine.gguf_fixtures import write_tiny
from tests.engine.scripted_runner import ScriptedRunner

from .test_serving_core import MODEL, Pool, Stream

REFERENCE = cases.chat_reference()
EXTRA_MARKERS = {"openai-gpt-oss-120b": ["<|call|>", "<|return|>"]}


@lru_cache(maxsize=None)
def model(template: str, tmp: str) -> str:
    """A tiny GGUF with `template`'s chat template, whose format markers are special tokens."""
    # llama.cpp's preserved tokens that are whole tags (MiniMax's `<invoke name="` and `">` are
    # not tokens of its vocabulary, and llama.cpp's vocabulary load refuses them as special ones)
    markers = [m for m in REFERENCE[template]["apply"]["tools"]["preserved_tokens"] + EXTRA_MARKERS.get(template, [])
               if m.endswith(">") and '"' not in m]
    path = write_tiny(Path(tmp) / f"{template}.gguf", "llama", n_layer=1, n_embd=16, n_head=2, n_head_kv=1,
                      n_ff=16, chat_template=cases.template(template), markers=markers[:14])
    return str(path)


class ScriptedEngine:
    """The engine client the web app talks to. Each request's reply is `director(request)` (by
    default `reply`); one scheduler serves them all, so the prompt cache keeps a slot's tokens
    from one request to the next as the engine's does, and `usage.cached_tokens` says so."""

    stats = None
    lora = None   # as EngineClient's before any POST /lora-adapters: the flags' scales
    state = EngineState("ready", "", None, 0)   # as EngineClient's, for /health (the chat page polls it)

    def __init__(self, path: str | None, n_ctx: int = 2048, prompt_cache: str = "off",
                 director: Callable[[Request], str] | None = None, runner=None) -> None:
        self.runner = runner if runner is not None else ScriptedRunner(Path(path), n_ctx)
        n_ctx = self.runner.info.n_ctx
        self.info = self.runner.info
        self.prompts = PromptBuilder(self.runner, self.info)
        self.reply, self.n, self.tokens, self.generated = "", 0, [], []
        self.director = director or (lambda request: self.reply)
        self.events: queue.Queue = queue.Queue()
        self.turns: list[tuple[int, int]] = []   # each request's (prompt tokens, of them read from the cache)
        self.prompts_seen: list[str] = []        # each request's prompt as the template rendered it
        self.sched = Scheduler(self.runner, EngineConfig(n_slots=1, n_ctx=n_ctx, prompt_cache=prompt_cache),
                               self._emit)
        self.lock = threading.Lock()   # one request at a time: the runner holds one script

    def new_id(self, prefix: str) -> str:
        with self.lock:
            self.n += 1
            return f"{prefix}-{self.n}"

    def submit(self, request: Request) -> Stream:
        """The request's stream at once, its events put there as the scheduler makes them (a
        thread runs it to its end, as the engine process does); one request at a time."""
        self.lock.acquire()
        try:
            self.prompts_seen.append(self.prompts.prompt_ids(request)[1])
            prep = self.prompts.prepare(request)
            self.tokens = self.runner.say(self.director(request), len(prep.ids))
            stream = _Aborting(request.id, self.sched)
            self.events = stream.queue
            self.sched.submit(request, prep.ids, prep.matcher, prep.parser, prep.more)
        except BaseException:
            self.lock.release()
            raise
        threading.Thread(target=self._run, daemon=True).start()
        return stream

    def render_prompt(self, request: Request) -> Tokenized:
        """The prompt `request` would be given, as the engine loop answers RenderPrompt."""
        ids, text = self.prompts.prompt_ids(request)
        return Tokenized(request.id, tuple(ids), text=text)

    def _emit(self, ev) -> None:
        if isinstance(ev, Done):     # before the stream ends: a test reads these once it has
            self.generated = list(ev.token_ids)
            self.turns.append((ev.usage.prompt_tokens, ev.usage.cached_tokens))
        self.events.put(ev)

    def _run(self) -> None:
        try:
            while self.sched.has_work():
                self.sched.step()
        finally:
            self.lock.release()

    def in_flight(self) -> int:
        return 0


class _Aborting(Stream):
    """A request's stream whose abort (the client left) cancels it in the scheduler, as the
    engine client's does: the slot is freed at the next step and keeps what was prefilled."""

    def __init__(self, request_id: str, sched: Scheduler) -> None:
        super().__init__(request_id, [])
        self.sched = sched

    def abort(self) -> None:
        super().abort()
        self.sched.abort(self.id)


class ScriptedPool(Pool):
    """One scripted model named `name`, served under any name (as the server does with one chat
    model)."""

    def __init__(self, engine: ScriptedEngine, name: str = MODEL) -> None:
        self.engine, self.default = engine, name

    def resolve(self, name=None, exact=False):
        return self.default

    def names(self) -> list[str]:
        return [self.default]

    def in_flight(self) -> int:
        return 0

    def status(self) -> list[dict[str, Any]]:
        return [{"name": self.default, "state": "loaded", "default": True, "kind": "chat", "source": "scripted",
                 "path": self.engine.info.model_path, "settings": {}, "loads": 1, "n_ctx": self.engine.info.n_ctx,
                 "n_slots": 1, "kv_bytes": 0, "in_flight": 0}]


def app_for(engine: ScriptedEngine, tmp: str, name: str = "scripted", model_name: str = MODEL):
    from web import create_app

    return create_app(Config(server=ServerConfig(conversations_db=f"{tmp}/c-{name}.db")),
                      ScriptedPool(engine, model_name))


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """The app on a real socket (werkzeug's threaded server) until the block ends: its base URL."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
