"""The soak's mix of requests (`appliance bench --soak`): what each kind sends, what answer it
expects, and what one request came to (`Outcome`).

    chat          non-streamed chat                                       expects 200
    stream        streamed chat; TTFT = first content - request sent       expects 200
    tools         chat with tools and tool_choice "required"               expects 200
    structured    response_format json_schema                              expects 200
    cancel        streamed, the client hangs up after a few content chunks expects 200
    over-context  a prompt longer than the context                         expects 400
    bad-json      a body that is not JSON                                  expects a 4xx
    bad-types     JSON with fields of the wrong type                       expects a 4xx

A 503 whose error code is queue_full is the server saying so when its queue is full: acceptable
for any kind. Prompts come from the shipped prompt sets. Half of the chat-like requests start
with a fresh nonce, so the prompt cache misses; the other half start with one of two shared
documents longer than one prefill block, so the cache serves that block once any client has sent
the document (the cache reuses whole 512-token blocks only: a shorter prompt, repeated, is never
a hit). Tool requests start with a nonce half the time.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from . import prompt_sets
from .client import Target
from .session import Prompts, nonce

CHAT = "/v1/chat/completions"
QUEUE_FULL = "queue_full"
NO_ANSWER = 0              # the status of a request that got no HTTP answer at all
CHAT_SETS = ("prose", "code", "repetitive")
SOAK_TOOLS = ("read_file", "list_directory")   # two of the tool-calls set's, the shortest
SHARED_DOC_TOKENS = 560    # one 512-token block of shared prefix, and a little more
SHARED_DOCS = 2
MIN_CTX = 1024             # the largest request: a shared document, a ~300-token prompt, 64 generated
CANCEL_AFTER_CHUNKS = 3
REQUEST_TIMEOUT_S = 300.0
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
                 "required": ["answer"]}
BAD_BODIES = (b'{"model": "x", "messages": [{"role": "user", "content": "hi"', b"not json at all",
              b'{"messages": [}', b"\xff\xfe{}")


@dataclass(frozen=True)
class Outcome:
    """One request of the soak, as its client saw it."""

    kind: str
    phase: str                     # warm-up or run
    at_s: float                    # when it was sent, seconds after the soak started
    status: int                    # HTTP status; NO_ANSWER when the connection failed
    code: str                      # the error's code (queue_full, invalid_request), "" on success
    latency_ms: float              # to the whole answer (a cancelled stream: to the hang-up)
    ttft_ms: float | None          # streamed kinds: to the first content
    prompt_set: str = "none"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0

    @property
    def status_key(self) -> str:
        """How the report counts it: "200", "400", "503 queue_full", "no answer"."""
        if self.status == NO_ANSWER:
            return "no answer"
        return f"{self.status} {self.code}" if self.status >= 500 and self.code else str(self.status)


def expected(expects: str, o: Outcome) -> bool:
    """Whether `o` is an answer a kind expecting `expects` ("200", "400", "4xx") takes as right."""
    if o.status == 503 and o.code == QUEUE_FULL:
        return True
    if expects.endswith("xx"):
        return o.status // 100 == int(expects[0])
    return o.status == int(expects)


@dataclass(frozen=True)
class Kind:
    name: str
    expects: str                      # the HTTP status it expects: "200", "400", or a class ("4xx")
    streamed: bool
    send: Callable[["Client", random.Random, str], Outcome]


class Material:
    """Prompts shared by every client, built once: chat messages by prompt set; for tools, the
    first user turns of the tool-calls set with two of its tools (its whole conversations run
    to 1,500 tokens: a soak wants many requests, not long prefills); and a prompt over the
    context."""

    def __init__(self, target: Target, n_ctx: int) -> None:
        self.chat = [(name, p.messages) for name in CHAT_SETS for p in prompt_sets.load(name).prompts]
        agent = prompt_sets.load("tool-calls").prompts
        self.tools = [t for t in agent[0].tools or () if t["function"]["name"] in SOAK_TOOLS]
        self.tool_turns = [[next(m for m in p.messages if m["role"] == "user")] for p in agent]
        prompts = Prompts(target)
        chars = prompts.chars_for(SHARED_DOC_TOKENS)   # cut there: filler runs on to a paragraph's end
        self.documents = [prompt_sets.filler(chars, seed=k)[:chars] for k in range(SHARED_DOCS)]
        self.over_context = _over_context(target, prompts, n_ctx) if n_ctx else None


def _over_context(target: Target, prompts: Prompts, n_ctx: int) -> str:
    """Filler prose of more tokens than the context holds (by the server's own tokenizer)."""
    chars = prompts.chars_for(int(n_ctx * 1.25) + 256)
    while True:
        text = prompt_sets.filler(chars, seed=n_ctx)
        if target.count_tokens(text) > n_ctx + 16:
            return text
        chars *= 2


class Client:
    """One client thread's connection (its own HTTP session) and what it sends with."""

    def __init__(self, url: str, api_key: str | None, model_id: str, material: Material, t0: float) -> None:
        self.target = Target(url, api_key, timeout=REQUEST_TIMEOUT_S)
        self.model_id, self.material, self.t0 = model_id, material, t0

    def close(self) -> None:
        self.target.close()

    def post(self, body: dict[str, Any] | None = None, raw: bytes | None = None,
             stream: bool = False) -> requests.Response:
        headers = {"Content-Type": "application/json"} if raw is not None else None
        return self.target.http.post(self.target.url + CHAT, json=body, data=raw, headers=headers,
                                     stream=stream, timeout=REQUEST_TIMEOUT_S)

    def outcome(self, kind: str, phase: str, t_send: float, status: int, code: str = "",
                ttft_s: float | None = None, usage: dict[str, Any] | None = None,
                prompt_set: str = "none") -> Outcome:
        usage = usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Outcome(kind, phase, round(t_send - self.t0, 3), status, code,
                       1000.0 * (time.perf_counter() - t_send),
                       None if ttft_s is None else 1000.0 * ttft_s, prompt_set,
                       int(usage.get("prompt_tokens") or 0), int(cached), int(usage.get("completion_tokens") or 0))


# -- bodies --------------------------------------------------------------------------------

def _varied(messages: Sequence[dict], rng: random.Random) -> list[dict]:
    """The prompt as shipped (a cache hit once any client has sent it) or after a fresh nonce (a miss)."""
    return prompt_sets.with_nonce(messages, nonce()) if rng.random() < 0.5 else [dict(m) for m in messages]


def _with_document(messages: Sequence[dict], document: str) -> list[dict]:
    """The messages after a shared document, put at the start of the system message (one is
    made when there is none), so every request naming it shares the same long prefix."""
    out = [dict(m) for m in messages]
    own = out.pop(0)["content"] if out and out[0].get("role") == "system" else ""
    return [{"role": "system", "content": f"Background reading:\n\n{document}\n\n{own}".rstrip()}, *out]


def _chat_body(c: Client, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    name, messages = rng.choice(c.material.chat)
    if rng.random() < 0.5:
        messages = prompt_sets.with_nonce(messages, nonce())            # a miss
    else:
        messages = _with_document(messages, rng.choice(c.material.documents))   # a hit once sent
    return name, {"model": c.model_id, "messages": messages, "max_tokens": max_tokens}


def _bad_types(c: Client, rng: random.Random) -> dict[str, Any]:
    return rng.choice([
        {"model": c.model_id, "messages": "hello", "max_tokens": 8},
        {"model": c.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
        {"model": c.model_id, "messages": [{"role": 7, "content": "hi"}]},
        {"model": c.model_id, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        {"model": c.model_id, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
    ])


# -- sending -------------------------------------------------------------------------------

def _error_code(r: requests.Response) -> str:
    try:
        err = r.json()["error"]
        return str(err.get("code") or err.get("type") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def _plain(c: Client, kind: str, phase: str, body: dict[str, Any] | None = None, raw: bytes | None = None,
           prompt_set: str = "none") -> Outcome:
    """A non-streamed request: status, error code, usage."""
    t = time.perf_counter()
    try:
        r = c.post(body, raw)
    except requests.RequestException as e:
        return c.outcome(kind, phase, t, NO_ANSWER, type(e).__name__, prompt_set=prompt_set)
    if r.status_code != 200:
        return c.outcome(kind, phase, t, r.status_code, _error_code(r), prompt_set=prompt_set)
    try:
        usage = r.json().get("usage")
    except ValueError:
        return c.outcome(kind, phase, t, r.status_code, "not json", prompt_set=prompt_set)
    return c.outcome(kind, phase, t, 200, usage=usage, prompt_set=prompt_set)


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def _streamed(c: Client, kind: str, phase: str, body: dict[str, Any], prompt_set: str,
              hang_up_after: int | None = None) -> Outcome:
    """A streamed request, read to its end or, with `hang_up_after`, until that many content
    chunks came and the client closes the connection. An error event inside a 200 stream counts
    as a 500 with its code: the server failed after it had started answering."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t = time.perf_counter()
    first: float | None = None
    chunks, usage = 0, None
    try:
        with c.post(body, stream=True) as r:
            if r.status_code != 200:
                return c.outcome(kind, phase, t, r.status_code, _error_code(r), prompt_set=prompt_set)
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                    return c.outcome(kind, phase, t, 500, str(err.get("code") or "stream error"),
                                     prompt_set=prompt_set)
                if _has_content(chunk):
                    first = first or time.perf_counter()
                    chunks += 1
                usage = chunk.get("usage") or usage
                if hang_up_after is not None and chunks >= hang_up_after:
                    break                      # leaving the with-block closes the connection
    except (requests.RequestException, ValueError) as e:
        return c.outcome(kind, phase, t, NO_ANSWER, type(e).__name__, prompt_set=prompt_set)
    return c.outcome(kind, phase, t, 200, ttft_s=None if first is None else first - t, usage=usage,
                     prompt_set=prompt_set)


def _chat(c: Client, rng: random.Random, phase: str) -> Outcome:
    name, body = _chat_body(c, rng, 16)
    return _plain(c, "chat", phase, body, prompt_set=name)


def _stream(c: Client, rng: random.Random, phase: str) -> Outcome:
    name, body = _chat_body(c, rng, 16)
    return _streamed(c, "stream", phase, body, name)


def _tools(c: Client, rng: random.Random, phase: str) -> Outcome:
    body = {"model": c.model_id, "messages": _varied(rng.choice(c.material.tool_turns), rng),
            "tools": c.material.tools, "tool_choice": "required", "max_tokens": 48}
    return _plain(c, "tools", phase, body, prompt_set="tool-calls")


def _structured(c: Client, rng: random.Random, phase: str) -> Outcome:
    name, body = _chat_body(c, rng, 32)
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    return _plain(c, "structured", phase, body, prompt_set=name)


def _cancel(c: Client, rng: random.Random, phase: str) -> Outcome:
    name, body = _chat_body(c, rng, 64)
    return _streamed(c, "cancel", phase, body, name, hang_up_after=CANCEL_AFTER_CHUNKS)


def _over(c: Client, rng: random.Random, phase: str) -> Outcome:
    text = f"[{nonce()}] {c.material.over_context}"
    body = {"model": c.model_id, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return _plain(c, "over-context", phase, body, prompt_set="filler")


def _bad_json(c: Client, rng: random.Random, phase: str) -> Outcome:
    return _plain(c, "bad-json", phase, raw=rng.choice(BAD_BODIES))


def _bad_type(c: Client, rng: random.Random, phase: str) -> Outcome:
    return _plain(c, "bad-types", phase, _bad_types(c, rng))


KINDS = (Kind("chat", "200", False, _chat), Kind("stream", "200", True, _stream), Kind("tools", "200", False, _tools),
         Kind("structured", "200", False, _structured), Kind("cancel", "200", True, _cancel),
         Kind("over-context", "400", False, _over), Kind("bad-json", "4xx", False, _bad_json),
         Kind("bad-types", "4xx", False, _bad_type))
BY_NAME = {k.name: k for k in KINDS}


def kinds_for(material: Material) -> tuple[Kind, ...]:
    """The kinds this server can be sent: over-context needs its context size."""
    return tuple(k for k in KINDS if k.name != "over-context" or material.over_context is not None)
