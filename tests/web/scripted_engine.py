"""A loaded model for the web app whose replies are scripted: the engine's own pieces in-process
(prompt builder, one scheduler with its prompt cache, output parser, grammar) over
tests/engine/scripted_runner.py, on a tiny GGUF that carries a real model's chat template and its
format's markers as special tokens. `ScriptedPool` serves it as the only model, so the whole app
(every dialect) answers with the script, through Flask's test client or, with `serve`, over a real
socket to clients in other processes (the coding agents' CLIs)."""
from __future__ import annotations

import contextlib
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

from appliance.config import Config, EngineConfig, ServerConfig
from appliance.engine.prompts import PromptBuilder
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Done, Request
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

    def __init__(self, path: str, n_ctx: int = 2048, prompt_cache: str = "off",
                 director: Callable[[Request], str] | None = None) -> None:
        self.runner = ScriptedRunner(Path(path), n_ctx)
        self.info = self.runner.info
        self.prompts = PromptBuilder(self.runner, self.info)
        self.reply, self.n, self.tokens, self.generated = "", 0, [], []
        self.director = director or (lambda request: self.reply)
        self.events: list = []
        self.turns: list[tuple[int, int]] = []   # each request's (prompt tokens, of them read from the cache)
        self.sched = Scheduler(self.runner, EngineConfig(n_slots=1, n_ctx=n_ctx, prompt_cache=prompt_cache),
                               lambda ev: self.events.append(ev))
        self.lock = threading.Lock()   # one request at a time: the runner holds one script

    def new_id(self, prefix: str) -> str:
        with self.lock:
            self.n += 1
            return f"{prefix}-{self.n}"

    def submit(self, request: Request) -> Stream:
        with self.lock:
            prep = self.prompts.prepare(request)
            self.tokens = self.runner.say(self.director(request), len(prep.ids))
            self.events = []
            self.sched.submit(request, prep.ids, prep.matcher, prep.parser, prep.more)
            while self.sched.has_work():
                self.sched.step()
            done = next((e for e in self.events if isinstance(e, Done)), None)
            self.generated = list(done.token_ids) if done is not None else []
            if done is not None:
                self.turns.append((done.usage.prompt_tokens, done.usage.cached_tokens))
            return Stream(request.id, self.events)

    def in_flight(self) -> int:
        return 0


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
