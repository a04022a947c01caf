"""The API blueprint: /v1/chat/completions, /v1/completions, /v1/models, /health,
llama-server's /tokenize and /detokenize, and /api/models/load and /unload.

A request's "model" picks one of the pool's models (engine/pool.py), loaded on request; a
streamed request for a model that is loading gets its 200 and SSE comment lines until the model
is ready, and an error after that travels in the stream.

A request is validated (wire.py), submitted to the engine, and answered only after the engine
has accepted it, so a prompt over the context is a plain HTTP 400 before any stream byte.
While waiting for events the handler checks whether the client is still there; a client that
leaves aborts its request, which frees its slot within one scheduler step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from flask import Blueprint, Response, current_app, g, jsonify, request, stream_with_context

from appliance.engine.reasoning import has_thinking_switch
from appliance.engine.process import EngineClient, RequestStream
from appliance.engine.types import Accepted, Delta, Done, Request, Tokenized
from appliance.errors import ApplianceError, EngineFailure, EngineUnavailable, InvalidRequest

from . import responses, wire

bp = Blueprint("api", __name__)
log = logging.getLogger("appliance.api")

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


def _state():
    return current_app.extensions["appliance"]


def _pool():
    return _state().pool


def _served(name: str, engine: EngineClient) -> set[str]:
    info = engine.info
    return {name, name + ".gguf"} | ({info.model_name, info.model_name + ".gguf"} if info else set())


def _n_ctx(engine: EngineClient) -> int:
    info = engine.info
    if info is None:
        raise EngineUnavailable(f"the engine is {engine.state.status}: {engine.state.reason}")
    return info.n_ctx


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def keep_alive(body: dict[str, Any]) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a duration ("5m", "1h30m", "90s"); 0 unloads
    the model when the request ends, a negative value keeps it loaded. None when absent."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            return float(text)
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(n) * _UNIT_S[u] for n, u in parts)
    raise InvalidRequest("'keep_alive' must be seconds or a duration such as \"5m\" or \"1h\" "
                         "(0: unload after this request; negative: keep loaded)", param="keep_alive")


def need(ok: bool, message: str, param: str) -> None:
    """A translated API's check: a 400 naming the parameter unless `ok`."""
    if not ok:
        raise InvalidRequest(message, param=param)


def resolve_model(body: dict[str, Any]) -> str:
    """The served model a translated API's body names (required there); the rule for a name no
    model has (clients such as Claude Code or Codex send their own) is `pool.resolve`'s."""
    model = body.get("model")
    need(isinstance(model, str) and model != "", "'model' is required: a string", "model")
    return _pool().resolve(model)


def _chat_model(name: str) -> str:
    """`name`, unless it is an embedding model, which answers embeddings only (a 400)."""
    if _pool().kind(name) == "embedding":
        raise InvalidRequest(f"the model {name} is an embedding model: it answers /v1/embeddings and /api/embed, "
                             "not chat, completions or tokenize", param="model")
    return name


def _as_served(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The body naming the model that answers it (for an alias or a file name: the reply reports
    the real id); a model that is not a string is left to the validation's 400."""
    model = body.get("model")
    return {**body, "model": name} if model is None or isinstance(model, str) else body


@contextlib.contextmanager
def _model(body: dict[str, Any], embeddings: bool = False) -> Iterator[tuple[str, EngineClient]]:
    """(name, ready engine) of the model the body names (for `embeddings`: the model that embeds,
    `pool.resolve_embedding`), loaded first if need be; the model stays loaded while the block
    runs (a request submitted inside it keeps it busy after)."""
    pool = _pool()
    name = pool.resolve_embedding(body.get("model")) if embeddings else _chat_model(pool.resolve(body.get("model")))
    engine = pool.acquire(name, keep_alive(body))
    try:
        yield name, engine
    finally:
        pool.release(name)


def _client_gone() -> Callable[[], bool]:
    """A check that the client hung up (waitress's flag: an attribute read, cheap per event)."""
    probe = request.environ.get("waitress.client_disconnected")
    return probe if probe is not None else (lambda: False)


IDLE = object()  # _wait's answer when `idle` seconds passed without an event


def _wait(stream: RequestStream, gone: Callable[[], bool], idle: float | None = None):
    """The next event; None if the client left; IDLE after `idle` seconds without one."""
    deadline = time.monotonic() + idle if idle else None
    while True:
        ev = stream.get(timeout=POLL_S if deadline is None else
                        max(0.0, min(POLL_S, deadline - time.monotonic())))
        if gone():
            stream.abort()
            return None
        if ev is not None:
            return ev
        if deadline is not None and time.monotonic() >= deadline:
            return IDLE


class Tally:
    """Per-request figures for /metrics, measured where the client sees them: at the server."""

    def __init__(self) -> None:
        self.metrics = _state().metrics
        self.t0 = g.get("t0", time.perf_counter())
        self.last: float | None = None

    def delta(self, ev: Delta) -> None:
        if not (ev.text or ev.call_parts):
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.t0)
        else:
            self.metrics.token_gap.observe(now - self.last)
        self.last = now

    def done(self, ev: Done) -> None:
        self.metrics.prompt_tokens.inc(ev.usage.prompt_tokens)
        self.metrics.generated_tokens.inc(ev.usage.completion_tokens)
        self.metrics.duration.observe(time.perf_counter() - self.t0)


def _body() -> dict[str, Any]:
    """The request's JSON object; refused while the server drains."""
    if _state().draining:
        raise EngineUnavailable("the server is shutting down")
    return wire.parse_json_body(request.get_data(cache=False), request.content_type)


@dataclass
class Submitted:
    """A request the engine accepted: its events come on `stream`."""

    parsed: wire.ParsedRequest
    stream: RequestStream
    gone: Callable[[], bool]       # whether the client hung up
    fingerprint: str
    accepted: Accepted


def _submit(engine: EngineClient, parsed: wire.ParsedRequest) -> Submitted:
    gone = _client_gone()
    if gone():  # it left while its request waited for a worker thread: do no work for it
        raise EngineUnavailable("client disconnected")
    stream = engine.submit(parsed.request)
    accepted = _wait(stream, gone)  # Accepted, or raises the engine's error (a 4xx/5xx)
    if accepted is None:
        raise EngineUnavailable("client disconnected")
    return Submitted(parsed, stream, gone, _state().fingerprint(engine), accepted)


def parse_submit(body: dict[str, Any], chat: bool,
                 adjust: Callable[[Request], Request] | None = None) -> Submitted:
    """Validate an OpenAI body against the model's engine and submit it (every API's way in:
    the others translate their bodies to this one). `adjust` sets on the validated request
    what another API asks that the OpenAI body cannot say (llama-server's n_probs, grammar)."""
    parse = wire.parse_chat if chat else wire.parse_completion
    with _model(body) as (name, engine):
        parsed = parse(_as_served(body, name), engine.new_id("chatcmpl" if chat else "cmpl"), _served(name, engine),
                       _n_ctx(engine))
        if adjust is not None:
            parsed = dataclasses.replace(parsed, request=adjust(parsed.request))
        return _submit(engine, parsed)


def render_prompt(body: dict[str, Any]) -> Tokenized:
    """The prompt an OpenAI chat body would be given, rendered and tokenized by the model's
    engine (its ids and text); nothing is generated."""
    with _model(body) as (name, engine):
        parsed = wire.parse_chat(_as_served(body, name), engine.new_id("render"), _served(name, engine), _n_ctx(engine))
        return engine.render_prompt(parsed.request)


def collect(sub: Submitted, tally: Tally | None = None) -> tuple[list[Delta], Done] | None:
    """All of a submitted request's events: its deltas and its Done (None: the client left)."""
    tally = tally or Tally()
    deltas: list[Delta] = []
    try:
        while True:
            ev = _wait(sub.stream, sub.gone)
            if ev is None:
                return None
            if isinstance(ev, Delta):
                tally.delta(ev)
                deltas.append(ev)
            elif isinstance(ev, Done):
                tally.done(ev)
                return deltas, ev
    finally:
        sub.stream.abort()


def _complete(chat: bool) -> Any:
    body = _body()
    pool = _pool()
    name = _chat_model(pool.resolve(body.get("model")))
    keepalive = _state().config.server.keepalive_s
    if body.get("stream") is True and pool.state_of(name) != "loaded" and keepalive > 0:
        return _sse_response(stream_with_context(_load_then_stream(body, chat, name, keepalive)))
    sub = parse_submit(body, chat)
    tally = Tally()
    if sub.parsed.stream:
        writer = responses.ChunkWriter(sub.parsed, chat, sub.fingerprint)
        return _sse_response(stream(sub, writer, tally, keepalive))
    got = collect(sub, tally)
    if got is None:
        return Response(status=499)  # nobody is listening
    build = responses.chat_response if chat else responses.completion_response
    return jsonify(build(sub.parsed, *got, sub.fingerprint))


def _sse_response(chunks: Iterator[bytes]) -> Response:
    return Response(chunks, mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _load_then_stream(body: dict[str, Any], chat: bool, name: str, keepalive: float) -> Iterator[bytes]:
    """A streamed request for a model not loaded: comment lines while it loads (in a thread, so
    the client hears from the server), then the stream; an error after the 200 goes in it."""
    loaded: dict[str, Any] = {}
    pool = _pool()

    def load() -> None:
        try:
            pool.load(name)
        except ApplianceError as e:
            loaded["error"] = e

    t = threading.Thread(target=load, name=f"load-{name}", daemon=True)
    t.start()
    gone = _client_gone()
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
        sub = parse_submit(body, chat)
    except ApplianceError as e:
        yield responses.ChunkWriter.error(e)
        return
    yield from stream(sub, responses.ChunkWriter(sub.parsed, chat, sub.fingerprint), Tally(), keepalive)


class StreamWriter(Protocol):
    """One streamed reply in an API's format: `stream` writes what each event becomes."""

    def start(self) -> bytes: ...
    def delta(self, ev: Delta) -> bytes: ...
    def end(self, done: Done) -> bytes: ...
    def error(self, e: ApplianceError) -> bytes: ...
    def idle(self) -> bytes: ...


def stream(sub: Submitted, writer: StreamWriter, tally: Tally, keepalive: float) -> Iterator[bytes]:
    """A submitted request's events, each written as it comes (every streamed API's one loop)."""
    try:
        first = writer.start()
        if first:
            yield first
        waiting = True  # until the first token: keep the connection alive through queue and prefill
        while True:
            try:
                ev = _wait(sub.stream, sub.gone, keepalive if waiting and keepalive > 0 else None)
            except ApplianceError as e:  # after the status line: the error travels in the stream
                yield writer.error(e)
                return
            if ev is None:
                return
            if ev is IDLE:
                yield writer.idle()
            elif isinstance(ev, Delta):
                waiting = False
                tally.delta(ev)
                yield writer.delta(ev)
            elif isinstance(ev, Done):
                tally.done(ev)
                yield writer.end(ev)
                return
    except Exception:  # a bug after the status line: an error event, not a dropped connection
        log.exception("streamed request %s failed", sub.stream.id)
        yield writer.error(EngineFailure("internal server error"))
    finally:
        sub.stream.abort()  # a no-op when finished; frees the slot when the client left


def stream_response(sub: Submitted, writer: StreamWriter) -> Response:
    """A translated API's streamed reply (its 200 goes out now; the prompt was accepted)."""
    chunks = stream(sub, writer, Tally(), _state().config.server.keepalive_s)
    return _sse_response(stream_with_context(chunks))


@bp.post("/v1/chat/completions")
def chat_completions():
    return _complete(chat=True)


@bp.post("/v1/completions")
def completions():
    return _complete(chat=False)


@bp.post("/tokenize")
def tokenize():
    body = _body()
    content, add_special, parse_special, with_pieces = wire.parse_tokenize(body)
    with _model(body) as (_, engine):
        ev = engine.tokenize(content, add_special, parse_special, with_pieces)
    return jsonify(wire.tokenize_response(ev, with_pieces))


@bp.post("/detokenize")
def detokenize():
    body = _body()
    ids = wire.parse_detokenize(body)
    with _model(body) as (_, engine):
        return jsonify({"content": engine.detokenize(ids).text})


def _model_card(name: str) -> dict[str, Any]:
    pool = _pool()
    state = pool.state_of(name)
    card: dict[str, Any] = {"id": name, "object": "model", "created": _state().started, "owned_by": "appliance",
                            "status": {"value": state}}
    engine = pool.client(name)
    info = engine.info if engine is not None and state == "loaded" else None
    if info is not None:
        card["context_length"] = info.n_ctx
        card["meta"] = {"arch": info.arch, "n_ctx_train": info.n_ctx_train, "n_vocab": info.n_vocab,
                        "n_slots": info.n_slots, "backend": info.backend}
    return card


@bp.get("/v1/models")
def models():
    return jsonify({"object": "list", "data": [_model_card(name) for name in _pool().names()]})


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str):
    return jsonify(_model_card(_pool().resolve(model_id, exact=True)))


@bp.post("/api/models/load")
def load_model():
    body = _body()
    pool = _pool()
    name = pool.resolve(_required_model(body), exact=True)
    t0 = time.perf_counter()
    engine = pool.load(name)
    return jsonify({"model": name, "state": pool.state_of(name), "n_ctx": engine.info.n_ctx,
                    "load_s": round(time.perf_counter() - t0, 3)})


@bp.post("/api/models/unload")
def unload_model():
    pool = _pool()
    name = pool.resolve(_required_model(_body()), exact=True)
    return jsonify({"model": name, "unloaded": pool.unload(name), "state": pool.state_of(name)})


def _required_model(body: dict[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str):
        raise InvalidRequest("'model' (a string) names the model", param="model")
    return name


@bp.get("/openapi.json")
def openapi_json():
    engine = _state().engine
    if engine is None:
        raise EngineUnavailable(f"the default model {_pool().default} is not loaded")
    # the builder is handed over by create_app: openapi.py describes every API, this one included
    build = current_app.config["OPENAPI_BUILD"]
    return jsonify(build(engine.info.model_name, _n_ctx(engine), engine.info.n_vocab))


@bp.get("/metrics")
def metrics():
    return Response(_state().metrics.render(), mimetype=None,
                    headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@bp.get("/health")
def health():
    """The default model's engine as before, and every model's state under "models". With
    several models, a default model that is not loaded is no failure (it loads on request).
    "exposed" and "warnings" say when the network gets all of it without a key; a caller
    without the key hears neither, as a server with a key is never exposed."""
    state, pool = _state(), _pool()
    engine = state.engine
    body: dict[str, Any] = {"status": "draining" if state.draining else "ok",
                            "uptime_s": round(time.time() - state.started, 1)}
    if engine is not None:
        st = engine.state
        body.update(engine_pid=st.pid, restarts=st.restarts)
        if st.status != "ready" and not state.draining:
            body["status"] = st.status
    if body["status"] == "ok" and engine is not None and engine.info is not None:
        info = engine.info
        body.update(model=info.model_name, model_fingerprint=info.fingerprint, backend=info.backend,
                    n_ctx=info.n_ctx, n_slots=info.n_slots, kv_bytes=info.kv_bytes,
                    settings=info.settings, placement=info.placement,
                    chat_template={"source": info.chat_template_source,
                                   "from_model": info.chat_template_source == "model",
                                   "thinking_switch": has_thinking_switch(info.chat_template)},
                    engine=engine.stats.as_dict() if engine.stats else {}, in_flight=pool.in_flight())
    elif body["status"] == "ok" and len(pool.names()) == 1:
        body["status"] = pool.state_of(pool.default)
    body["models"] = pool.status()
    warning = state.config.server.exposure()
    body.update(exposed=warning is not None, warnings=[warning] if warning else [])
    ok = body["status"] == "ok"
    if not ok:
        body["reason"] = (engine.state.reason if engine is not None and engine.state.reason else
                          next((m.get("reason") for m in body["models"] if m.get("reason")), None)
                          or "the server is shutting down")
    if not g.get("authorized", True):     # a monitor without the API key hears the status only
        body = {"status": body["status"], "uptime_s": body["uptime_s"]}
    resp = jsonify(body)
    if not ok:
        resp.status_code = 503
        resp.headers["Retry-After"] = "1"
    return resp
