"""The API blueprint: /v1/chat/completions, /v1/completions, /v1/models, /health, and
llama-server's /tokenize and /detokenize.

A request is validated (wire.py), submitted to the engine, and answered only after the engine
has accepted it, so a prompt over the context is a plain HTTP 400 before any stream byte.
While waiting for events the handler checks whether the client is still there; a client that
leaves aborts its request, which frees its slot within one scheduler step.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from flask import Blueprint, Response, current_app, g, jsonify, request

from appliance.engine.process import EngineClient, RequestStream
from appliance.engine.types import Delta, Done
from appliance.errors import ApplianceError, EngineUnavailable

from . import openapi, responses, wire

bp = Blueprint("api", __name__)

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


def _state():
    return current_app.extensions["appliance"]


def _engine() -> EngineClient:
    return _state().engine


def _served() -> set[str]:
    info = _engine().info
    return {info.model_name, info.model_name + ".gguf"} if info else set()


def _n_ctx() -> int:
    info = _engine().info
    if info is None:
        raise EngineUnavailable(f"the engine is {_engine().state.status}: {_engine().state.reason}")
    return info.n_ctx


def _client_gone() -> Callable[[], bool]:
    """A check that the client hung up (waitress's flag: an attribute read, cheap per event)."""
    probe = request.environ.get("waitress.client_disconnected")
    return probe if probe is not None else (lambda: False)


IDLE = object()  # _wait's answer when `idle` seconds passed without an event
KEEPALIVE = b": keep-alive\n\n"


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
        if not ev.text:
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


def _submit(parsed: wire.ParsedRequest) -> tuple[RequestStream, Callable[[], bool]]:
    gone = _client_gone()
    if gone():  # it left while its request waited for a worker thread: do no work for it
        raise EngineUnavailable("client disconnected")
    stream = _engine().submit(parsed.request)
    if _wait(stream, gone) is None:  # Accepted, or raises the engine's error (a 4xx/5xx)
        raise EngineUnavailable("client disconnected")
    return stream, gone


def _complete(chat: bool) -> Any:
    body = _body()
    prefix = "chatcmpl" if chat else "cmpl"
    parse = wire.parse_chat if chat else wire.parse_completion
    parsed = parse(body, _engine().new_id(prefix), _served(), _n_ctx())
    stream, gone = _submit(parsed)
    fingerprint = _state().fingerprint
    tally = Tally()
    if parsed.stream:
        keepalive = _state().config.server.keepalive_s
        return Response(_sse(stream, gone, responses.ChunkWriter(parsed, chat, fingerprint), tally, keepalive),
                        mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    deltas: list[Delta] = []
    try:
        while True:
            ev = _wait(stream, gone)
            if ev is None:
                return Response(status=499)  # nobody is listening
            if isinstance(ev, Delta):
                tally.delta(ev)
                deltas.append(ev)
            elif isinstance(ev, Done):
                tally.done(ev)
                break
    finally:
        stream.abort()
    build = responses.chat_response if chat else responses.completion_response
    return jsonify(build(parsed, deltas, ev, fingerprint))


def _sse(stream: RequestStream, gone: Callable[[], bool], writer: responses.ChunkWriter, tally: Tally,
         keepalive: float) -> Iterator[bytes]:
    try:
        first = writer.first()
        if first:
            yield first
        waiting = True  # until the first token: keep the connection alive through queue and prefill
        while True:
            try:
                ev = _wait(stream, gone, keepalive if waiting and keepalive > 0 else None)
            except ApplianceError as e:  # after the status line: the error travels in the stream
                yield writer.error(e.body())
                return
            if ev is None:
                return
            if ev is IDLE:
                yield KEEPALIVE
            elif isinstance(ev, Delta):
                waiting = False
                tally.delta(ev)
                yield writer.delta(ev)
            elif isinstance(ev, Done):
                tally.done(ev)
                yield writer.last(ev)
                return
    finally:
        stream.abort()  # a no-op when finished; frees the slot when the client left


@bp.post("/v1/chat/completions")
def chat_completions():
    return _complete(chat=True)


@bp.post("/v1/completions")
def completions():
    return _complete(chat=False)


@bp.post("/tokenize")
def tokenize():
    content, add_special, parse_special, with_pieces = wire.parse_tokenize(_body())
    ev = _engine().tokenize(content, add_special, parse_special, with_pieces)
    return jsonify(wire.tokenize_response(ev, with_pieces))


@bp.post("/detokenize")
def detokenize():
    return jsonify({"content": _engine().detokenize(wire.parse_detokenize(_body())).text})


def _model_card() -> dict[str, Any]:
    info = _engine().info
    return {"id": info.model_name, "object": "model", "created": _state().started, "owned_by": "appliance",
            "context_length": info.n_ctx,
            "meta": {"arch": info.arch, "n_ctx_train": info.n_ctx_train, "n_vocab": info.n_vocab,
                     "n_slots": info.n_slots, "backend": info.backend}}


@bp.get("/v1/models")
def models():
    _n_ctx()
    return jsonify({"object": "list", "data": [_model_card()]})


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str):
    _n_ctx()
    if model_id not in _served():
        wire.check_model({"model": model_id}, _served())
    return jsonify(_model_card())


@bp.get("/openapi.json")
def openapi_json():
    info = _engine().info
    n_ctx = _n_ctx()
    return jsonify(openapi.build(info.model_name, n_ctx, info.n_vocab))


@bp.get("/metrics")
def metrics():
    return Response(_state().metrics.render(), mimetype=None,
                    headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@bp.get("/health")
def health():
    engine = _engine()
    st = engine.state
    body: dict[str, Any] = {"status": st.status if not _state().draining else "draining",
                            "engine_pid": st.pid, "restarts": st.restarts,
                            "uptime_s": round(time.time() - _state().started, 1)}
    if st.status == "ready" and not _state().draining and engine.info is not None:
        info = engine.info
        body.update(status="ok", model=info.model_name, model_fingerprint=info.fingerprint,
                    backend=info.backend,
                    n_ctx=info.n_ctx, n_slots=info.n_slots, kv_bytes=info.kv_bytes,
                    settings=info.settings, placement=info.placement,
                    engine=engine.stats.as_dict() if engine.stats else {},
                    in_flight=engine.in_flight())
        return jsonify(body)
    body["reason"] = st.reason or "the server is shutting down"
    resp = jsonify(body)
    resp.status_code = 503
    resp.headers["Retry-After"] = "1"
    return resp
