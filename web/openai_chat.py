"""OpenAI's /v1/chat/completions and /v1/completions: one dialect of the serving core
(serving.py), whose wire format the others translate to.

A request's "model" picks one of the pool's models (engine/pool.py), loaded on request; a
streamed request for a model that is loading gets its 200 and SSE comment lines until the model
is ready, and an error after that travels in the stream.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

from flask import Blueprint, stream_with_context

from appliance.errors import ApplianceError

from . import responses, serving

bp = Blueprint("openai", __name__)


def _complete(chat: bool) -> Any:
    body = serving.read_body()
    pool = serving.pool()
    name = serving.chat_model(pool.resolve(body.get("model")))
    keepalive = serving.state().config.server.keepalive_s
    if body.get("stream") is True and pool.state_of(name) != "loaded" and keepalive > 0:
        return serving.streamed(stream_with_context(_load_then_stream(body, chat, name, keepalive)))
    sub = serving.parse_submit(body, chat)
    build = responses.chat_response if chat else responses.completion_response
    return serving.reply(sub, lambda: responses.ChunkWriter(sub.parsed, chat, sub.fingerprint),
                         lambda deltas, done: build(sub.parsed, deltas, done, sub.fingerprint))


def _load_then_stream(body: dict[str, Any], chat: bool, name: str, keepalive: float) -> Iterator[bytes]:
    """A streamed request for a model not loaded: comment lines while it loads (in a thread, so
    the client hears from the server), then the stream; an error after the 200 goes in it."""
    loaded: dict[str, Any] = {}
    pool = serving.pool()

    def load() -> None:
        try:
            pool.load(name)
        except ApplianceError as e:
            loaded["error"] = e

    t = threading.Thread(target=load, name=f"load-{name}", daemon=True)
    t.start()
    gone = serving.client_gone()
    yield b": loading " + name.encode() + b"\n\n"
    while t.is_alive():
        t.join(keepalive)
        if gone():
            return                       # the load goes on: the next request for it may want it
        if t.is_alive():
            yield responses.KEEPALIVE
    try:
        if "error" in loaded:
            raise loaded["error"]
        sub = serving.parse_submit(body, chat)
    except ApplianceError as e:
        yield responses.ChunkWriter.error(e)
        return
    writer = responses.ChunkWriter(sub.parsed, chat, sub.fingerprint)
    yield from serving.stream(sub, writer, serving.Tally(), keepalive)


@bp.post("/v1/chat/completions")
def chat_completions():
    return _complete(chat=True)


@bp.post("/v1/completions")
def completions():
    return _complete(chat=False)
