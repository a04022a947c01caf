"""The serving core every API dialect answers through: admission, the model a body names,
submission, collection, the one streaming loop, the per-request metrics tally and the check
that a client is still there.

A dialect's blueprint (OpenAI's chat and completions, Responses, Anthropic's messages, Ollama,
llama-server's native routes) translates its body into an OpenAI chat or completions body and
calls `parse_submit`: validated once (wire.py) against the model's engine, submitted, and
answered only after the engine accepted it, so a prompt over the context is a plain HTTP 400
before any stream byte (a completions body of several prompts is a request per prompt, their
events merged into one request's by batch.py). Then `reply` answers in the dialect's shape:
whole (`collect`, then the dialect's builder) or streamed (`stream`, through the dialect's
`StreamWriter`: SSE or NDJSON).
While waiting for events the handler checks whether the client is still there; a client that
leaves aborts its request, which frees its slot within one scheduler step. Every request's TTFT,
token gaps, tokens and duration go to /metrics through `Tally`, whichever dialect it came in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from flask import Response, current_app, g, jsonify, request, stream_with_context

from appliance.engine.pool import ModelPool
from appliance.engine.process import EngineClient, RequestStream
from appliance.engine.types import Accepted, Delta, Done, Event, Progress, Request, Tokenized
from appliance.errors import ApplianceError, EngineFailure, EngineUnavailable, InvalidRequest

from . import wire
from .batch import Merged
from .lora import with_global

log = logging.getLogger("appliance.api")

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def state():
    """The app's `web.AppState` (config, pool, metrics, draining)."""
    return current_app.extensions["appliance"]


def pool() -> ModelPool:
    return state().pool


def read_body() -> dict[str, Any]:
    """The request's JSON object; refused while the server drains."""
    if state().draining:
        raise EngineUnavailable("the server is shutting down")
    return wire.parse_json_body(request.get_data(cache=False))


def need(ok: bool, message: str, param: str) -> None:
    """A translated API's check: a 400 naming the parameter unless `ok`."""
    if not ok:
        raise InvalidRequest(message, param=param)


# -- the model a body names ------------------------------------------------------------------------
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


def resolve_model(body: dict[str, Any]) -> str:
    """The served model a translated API's body names (required there); the rule for a name no
    model has (clients such as Claude Code or Codex send their own) is `pool.resolve`'s."""
    model = body.get("model")
    need(isinstance(model, str) and model != "", "'model' is required: a string", "model")
    return pool().resolve(model)


def chat_model(name: str) -> str:
    """`name`, unless it is an embedding model, which answers embeddings only (a 400)."""
    if pool().kind(name) == "embedding":
        raise InvalidRequest(f"the model {name} is an embedding model: it answers /v1/embeddings and /api/embed, "
                             "not chat, completions or tokenize", param="model")
    return name


def n_ctx(engine: EngineClient) -> int:
    """The engine's context per slot (a 503 while it is not ready)."""
    info = engine.info
    if info is None:
        raise EngineUnavailable(f"the engine is {engine.state.status}: {engine.state.reason}")
    return info.n_ctx


@contextlib.contextmanager
def model(body: dict[str, Any], embeddings: bool = False) -> Iterator[tuple[str, EngineClient]]:
    """(name, ready engine) of the model the body names (for `embeddings`: the model that embeds,
    `pool.resolve_embedding`), loaded first if need be; the model stays loaded while the block
    runs (a request submitted inside it keeps it busy after)."""
    p = pool()
    name = p.resolve_embedding(body.get("model")) if embeddings else chat_model(p.resolve(body.get("model")))
    engine = p.acquire(name, keep_alive(body))
    try:
        yield name, engine
    finally:
        p.release(name)


def _served(name: str, engine: EngineClient) -> set[str]:
    info = engine.info
    return {name, name + ".gguf"} | ({info.model_name, info.model_name + ".gguf"} if info else set())


def _as_served(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The body naming the model that answers it (for an alias or a file name: the reply reports
    the real id); a model that is not a string is left to the validation's 400."""
    value = body.get("model")
    return {**body, "model": name} if value is None or isinstance(value, str) else body


# -- waiting on the engine ----------------------------------------------------------------------------
def client_gone() -> Callable[[], bool]:
    """A check that the client hung up (waitress's flag: an attribute read, cheap per event)."""
    probe = request.environ.get("waitress.client_disconnected")
    return probe if probe is not None else (lambda: False)


IDLE = object()  # wait's answer when `idle` seconds passed without an event


def wait(stream: RequestStream, gone: Callable[[], bool], idle: float | None = None):
    """The next event; None if the client left; IDLE after `idle` seconds without one. An Error
    event is raised as its typed error."""
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
        self.metrics = state().metrics
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


# -- submission -----------------------------------------------------------------------------------
@dataclass
class Submitted:
    """A request the engine accepted: its events come on `stream`."""

    parsed: wire.ParsedRequest
    stream: RequestStream | Merged       # Merged: a batch of prompts' requests as one (batch.py)
    gone: Callable[[], bool]       # whether the client hung up
    fingerprint: str
    accepted: Accepted


def _submit(engine: EngineClient, parsed: wire.ParsedRequest, gone: Callable[[], bool] | None) -> Submitted:
    gone = gone or client_gone()
    if gone():  # it left while its request waited for a worker thread: do no work for it
        raise EngineUnavailable("client disconnected")
    batch = parsed.batch
    stream = Merged.submit(engine, batch, parsed.request.id, parsed.request.n) if batch else engine.submit(parsed.request)
    accepted = wait(stream, gone)  # Accepted, or raises the engine's error (a 4xx/5xx)
    if accepted is None:
        raise EngineUnavailable("client disconnected")
    return Submitted(parsed, stream, gone, state().fingerprint(engine), accepted)


def parse_submit(body: dict[str, Any], chat: bool, adjust: Callable[[Request], Request] | None = None,
                 gone: Callable[[], bool] | None = None) -> Submitted:
    """Validate an OpenAI body against the model's engine and submit it (every API's way in:
    the others translate their bodies to this one). `adjust` sets on the validated request
    what another API asks that the OpenAI body cannot say (llama-server's n_probs, grammar).
    `gone` says when nobody wants the reply any more (default: the HTTP client hung up; a chat
    job's: it was stopped), and it then aborts the request; it needs no request context."""
    parse = wire.parse_chat if chat else wire.parse_completion
    with model(body) as (name, engine):
        parsed = parse(_as_served(body, name), engine.new_id("chatcmpl" if chat else "cmpl"), _served(name, engine),
                       n_ctx(engine))
        fix = lambda r: with_global(adjust(r) if adjust is not None else r, engine)  # noqa: E731
        parsed = dataclasses.replace(parsed, request=fix(parsed.request), batch=tuple(map(fix, parsed.batch)))
        return _submit(engine, parsed, gone)


def ceiling(max_tokens: int | None) -> Callable[[Request], Request] | None:
    """parse_submit's `adjust` for a max_tokens that is a ceiling (Anthropic's max_tokens, Ollama's
    num_predict): a prompt with less room than it is served up to the context's end."""
    if max_tokens is None:
        return None
    return lambda r: dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=max_tokens,
                                                                       max_tokens_ceiling=True))


def render_prompt(body: dict[str, Any]) -> Tokenized:
    """The prompt an OpenAI chat body would be given, rendered and tokenized by the model's
    engine (its ids and text); nothing is generated."""
    with model(body) as (name, engine):
        parsed = wire.parse_chat(_as_served(body, name), engine.new_id("render"), _served(name, engine), n_ctx(engine))
        return engine.render_prompt(parsed.request)


# -- answering ------------------------------------------------------------------------------------
def collect(sub: Submitted, tally: Tally | None = None) -> tuple[list[Delta], Done] | None:
    """All of a submitted request's events: its deltas and its Done (None: the client left)."""
    tally = tally or Tally()
    deltas: list[Delta] = []
    try:
        while True:
            ev = wait(sub.stream, sub.gone)
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


class StreamWriter(Protocol):
    """One streamed reply in an API's format: `stream` writes what each event becomes (b"": nothing)."""

    def start(self) -> bytes: ...
    def delta(self, ev: Delta) -> bytes: ...
    def end(self, done: Done) -> bytes: ...
    def error(self, e: ApplianceError) -> bytes: ...
    def idle(self) -> bytes: ...


def stream(sub: Submitted, writer: StreamWriter, tally: Tally, keepalive: float) -> Iterator[bytes]:
    """A submitted request's events, each written as it comes (every streamed API's one loop)."""
    try:
        yield from _written(writer.start())
        waiting = True  # until the first token: keep the connection alive through queue and prefill
        while True:
            try:
                ev = wait(sub.stream, sub.gone, keepalive if waiting and keepalive > 0 else None)
            except ApplianceError as e:  # after the status line: the error travels in the stream
                yield writer.error(e)
                return
            if ev is None:
                return
            if ev is IDLE:
                yield from _written(writer.idle())
                continue
            if isinstance(ev, Progress):   # the prompt is still being processed: keep-alives go on
                yield from _written(_progress(writer, ev))
                continue
            waiting = False
            chunks, ended = _ready(sub, writer, tally, ev)
            yield from _written(b"".join(chunks))
            if ended:
                return
    except Exception:  # a bug after the status line: an error event, not a dropped connection
        log.exception("streamed request %s failed", sub.stream.id)
        yield writer.error(EngineFailure("internal server error"))
    finally:
        sub.stream.abort()  # a no-op when finished; frees the slot when the client left


def _ready(sub: Submitted, writer: StreamWriter, tally: Tally, ev: Event) -> tuple[list[bytes], bool]:
    """`ev` and the events already waiting behind it, written: one write for what one engine
    message brought (each token still its own SSE event), so the server's writer and the client
    wake once a message, not once a token (on a small machine their CPU time is taken from the
    engine's compute threads). Whether the stream ended among them."""
    chunks: list[bytes] = []
    while ev is not None:
        if isinstance(ev, Delta):
            tally.delta(ev)
            chunks.append(writer.delta(ev))
        elif isinstance(ev, Done):
            tally.done(ev)
            chunks.append(writer.end(ev))
            return chunks, True
        elif isinstance(ev, Progress):
            chunks.append(_progress(writer, ev))
        try:
            ev = sub.stream.get_nowait()
        except ApplianceError as e:
            chunks.append(writer.error(e))
            return chunks, True
    return chunks, False


def _progress(writer: StreamWriter, ev: Progress) -> bytes:
    # only OpenAI's and llama-server's bodies can ask for progress; another dialect's writer has none
    progress = getattr(writer, "progress", None)
    return progress(ev) if progress is not None else b""


def _written(chunk: bytes) -> Iterator[bytes]:
    if chunk:
        yield chunk


def streamed(chunks: Iterator[bytes], mimetype: str = SSE) -> Response:
    """A response whose body goes out as it is made (no proxy buffering)."""
    return Response(chunks, mimetype=mimetype, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_response(sub: Submitted, writer: StreamWriter, mimetype: str = SSE) -> Response:
    """A streamed reply (its 200 goes out now; the prompt was accepted)."""
    chunks = stream(sub, writer, Tally(), state().config.server.keepalive_s)
    return streamed(stream_with_context(chunks), mimetype)


def reply(sub: Submitted, writer: Callable[[], StreamWriter], whole: Callable[[list[Delta], Done], Any],
          mimetype: str = SSE) -> Response:
    """A submitted request answered in a dialect's shape: streamed through `writer()` when it
    asked for a stream, else its events collected and built into one body by `whole`."""
    if sub.parsed.stream:
        return stream_response(sub, writer(), mimetype)
    got = collect(sub)
    if got is None:
        return Response(status=499)   # nobody is listening
    return jsonify(whole(*got))
