"""The serving core (web/serving.py) under every dialect: each API's requests, streamed or
whole, are counted in /metrics (TTFT, tokens, duration), and an engine error after the status
line ends each API's stream in its own error shape. Flask's test client over a pool whose engine
plays a scripted reply, so what is checked is the web layer, not a model."""
from __future__ import annotations

import json
import queue
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import Config, ServerConfig
from appliance.engine.types import Accepted, ChoiceEnd, Delta, Done, Error, Timings, Tokenized, Usage
from appliance.errors import ContextOverflow, from_wire
from appliance.library.catalog import ModelSpec
from tests.engine.fake_runner import FakeRunner
from web import create_app

MODEL = "fake"
USER = [{"role": "user", "content": "hi"}]
WORDS = ("Hello", " there", " friend")


class Stream:
    """One request's scripted events, as the engine client's RequestStream hands them out."""

    def __init__(self, request_id: str, events: list, shared: queue.Queue | None = None) -> None:
        self.id, self.queue, self.aborted = request_id, shared if shared is not None else queue.Queue(), False
        for ev in events:
            self.queue.put(ev)

    def get(self, timeout=None):
        try:
            ev = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(ev, Error):
            raise from_wire(ev.kind, ev.message, ev.fields)
        return ev

    def get_nowait(self):
        return self.get(timeout=0)

    def abort(self) -> None:
        self.aborted = True


class Engine:
    """A loaded model that answers every request with WORDS, or fails after the first (`fail`)."""

    info = FakeRunner().info
    stats = None
    lora = None   # as EngineClient's before any POST /lora-adapters: the flags' scales

    def __init__(self) -> None:
        self.fail = False
        self.refuse: Exception | None = None     # an error the engine answers a request with at once
        self.refused = lambda request: True      # ... which requests get it
        self.n = 0
        self.requests: list = []                 # what was submitted

    def new_id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}"

    def tokenize_many(self, texts):
        return [tuple(ord(c) for c in text) for text, _, _ in texts]    # a character a token

    def detokenize(self, ids):
        return Tokenized("detok", ids, text="".join(map(chr, ids)))

    def submit(self, request, events=None):
        """`events`: a batch's shared queue (web/batch.py)."""
        rid = request.id
        self.requests.append(request)
        if self.refuse is not None and self.refused(request):
            return Stream(rid, [Error(rid, *self.refuse.to_wire())], events)
        n = request.n     # each choice says WORDS, choice j's last word with its index
        deltas = [Delta(rid, w + (str(j) if j and i == len(WORDS) - 1 else ""), (i + 1,), index=j)
                  for i, w in enumerate(WORDS) for j in range(n)]
        ends = tuple(ChoiceEnd(j, "stop") for j in range(n)) if n > 1 else ()
        tail = ([Error(rid, "EngineFailure", "the engine process died", {})] if self.fail else
                [Done(rid, "stop", Usage(7, n * len(WORDS)), Timings(7, 0, 5.0, 2, 4.0, 2.0, 1),
                      token_ids=tuple(range(1, len(WORDS) + 1)), choices=ends)])
        return Stream(rid, [Accepted(rid, 7), *(deltas[:1] if self.fail else deltas), *tail], events)


class Pool:
    default = MODEL

    def __init__(self) -> None:
        self.engine = Engine()

    def resolve(self, name=None, exact=False):
        return MODEL

    def kind(self, name):
        return "chat"

    def acquire(self, name, keep_alive=None):
        return self.engine

    def release(self, name):
        pass

    def client(self, name=None):
        return self.engine

    def spec(self, name):
        return ModelSpec(name, Path(name + ".gguf"), "file")

    def state_of(self, name):
        return "loaded"

    def engine_pids(self):
        return {}


# each dialect: its route, a body asking for a stream, and how its stream says an error
DIALECTS = {
    "openai": ("/v1/chat/completions", {"model": MODEL, "messages": USER},
               lambda text: '"error"' in text and "the engine process died" in text),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi"},
                    lambda text: '"error"' in text and "the engine process died" in text),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi"},
                  lambda text: "event: error" in text and "the engine process died" in text),
    "anthropic": ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 16},
                  lambda text: "event: error" in text and "the engine process died" in text),
    "ollama": ("/api/chat", {"model": MODEL, "messages": USER},
               lambda text: json.loads(text.splitlines()[-1]) == {"error": "the engine process died"}),
    "ollama-generate": ("/api/generate", {"model": MODEL, "prompt": "hi"},
                        lambda text: json.loads(text.splitlines()[-1]) == {"error": "the engine process died"}),
    "llama-server": ("/completion", {"prompt": "hi"},
                     lambda text: '"error"' in text and "the engine process died" in text),
}


@pytest.fixture
def app(tmp_path):
    return create_app(Config(server=ServerConfig(conversations_db=str(tmp_path / "c.db"))), Pool())


def counted(app) -> dict[str, float]:
    text = app.test_client().get("/metrics").get_data(as_text=True)
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("appliance_time_to_first_token_seconds_count", "appliance_prompt_tokens_total",
                          "appliance_generated_tokens_total", "appliance_request_duration_seconds_count",
                          "appliance_inter_token_seconds_count")}


def stream_body(name: str) -> dict:
    _, body, _ = DIALECTS[name]
    return {**body, "stream": True} if name != "ollama" and name != "ollama-generate" else body  # Ollama streams by default


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_every_dialect_is_counted_in_metrics(app, name, streamed):
    path, body, _ = DIALECTS[name]
    body = stream_body(name) if streamed else {**body, "stream": False}
    resp = app.test_client().post(path, json=body)
    text = resp.get_data(as_text=True)
    assert resp.status_code == 200, text
    assert "there" in text and "friend" in text
    got = counted(app)
    assert got["appliance_time_to_first_token_seconds_count"] == 1
    assert got["appliance_inter_token_seconds_count"] == len(WORDS) - 1
    assert got["appliance_prompt_tokens_total"] == 7 and got["appliance_generated_tokens_total"] == len(WORDS)
    assert got["appliance_request_duration_seconds_count"] == 1


def test_an_ollama_stream_is_ndjson(app):
    resp = app.test_client().post("/api/chat", json={"model": MODEL, "messages": USER})
    assert resp.mimetype == "application/x-ndjson"
    lines = [json.loads(line) for line in resp.get_data(as_text=True).splitlines()]
    assert [ln["message"]["content"] for ln in lines[:-1]] == list(WORDS)
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == len(WORDS)


@pytest.mark.parametrize("name", DIALECTS)
def test_an_engine_error_mid_stream_ends_each_dialects_stream_in_its_shape(app, name):
    app.extensions["appliance"].pool.engine.fail = True
    path, _, says_error = DIALECTS[name]
    resp = app.test_client().post(path, json=stream_body(name))
    text = resp.get_data(as_text=True)
    assert resp.status_code == 200 and "Hello" in text      # the status line went out with the first token
    assert says_error(text), text
    assert counted(app)["appliance_time_to_first_token_seconds_count"] == 1


@pytest.mark.parametrize("path,body,kind", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, "invalid_request_error"),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER}, "invalid_request_error"),
    ("/completion", {"prompt": "hi"}, "exceed_context_size_error"),
    ("/completions", {"prompt": "hi"}, "exceed_context_size_error"),
    ("/chat/completions", {"messages": USER}, "exceed_context_size_error")])
def test_a_prompt_over_the_context_has_each_apis_error_type(app, path, body, kind):
    """llama-server's routes answer its type (its clients match it), OpenAI's their own; the
    counts are the same in both."""
    app.extensions["appliance"].pool.engine.refuse = ContextOverflow("too long", n_prompt_tokens=9, n_ctx=8)
    for stream in (False, True):
        r = app.test_client().post(path, json={**body, "stream": stream})
        err = r.get_json()["error"]
        assert r.status_code == 400 and err["type"] == kind, err
        assert (err["code"], err["n_prompt_tokens"], err["n_ctx"]) == ("context_length_exceeded", 9, 8)


class _Writer:
    def start(self): return b"start|"
    def delta(self, ev): return f"d:{ev.text}|".encode()
    def end(self, done): return b"end|"
    def error(self, e): return f"error:{e.message}|".encode()
    def idle(self): return b""


class _Tally:
    def __init__(self): self.deltas, self.ends = 0, 0
    def delta(self, ev): self.deltas += 1
    def done(self, ev): self.ends += 1


def _streamed(events):
    from types import SimpleNamespace

    from web import serving

    stream = Stream("r", events)
    sub = SimpleNamespace(stream=stream, gone=lambda: False)
    tally = _Tally()
    return list(serving.stream(sub, _Writer(), tally, keepalive=0)), tally


def test_the_events_waiting_together_go_out_in_one_write():
    """What one engine message brought is one write (the server's writer and the client wake
    once, not once a token), each token still its own event, in order."""
    deltas = [Delta("r", w, (i + 1,)) for i, w in enumerate(WORDS)]
    chunks, tally = _streamed([*deltas, Done("r", "stop", Usage(7, len(WORDS)), Timings(7, 0, 5.0, 2, 4.0, 2.0, 1))])
    assert chunks == [b"start|", b"".join(f"d:{w}|".encode() for w in WORDS) + b"end|"]
    assert (tally.deltas, tally.ends) == (len(WORDS), 1)   # /metrics still counts every token


def test_an_error_behind_waiting_tokens_goes_out_after_them():
    chunks, _ = _streamed([Delta("r", "Hello", (1,)), Delta("r", " there", (2,)),
                           Error("r", "EngineFailure", "the engine process died", {})])
    assert chunks == [b"start|", b"d:Hello|d: there|error:the engine process died|"]
