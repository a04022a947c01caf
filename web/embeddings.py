"""Embeddings as OpenAI's /v1/embeddings and llama-server's /embeddings (and its older
/embedding) answer them, and `embed`: the one way every API embeds (Ollama's /api/embed and
/api/embeddings use it too).

The model is `pool.resolve_embedding`'s: the embedding model (--embedding-model PATH) by its
name, or for no name or an unknown one (clients send text-embedding-3-small); under
--embedding-model chat the chat model a name picks, any name when one is served. An input is a
text, token ids, or llama-server's mix of both (`parse_input`: a list holding any token id is one
input); the engine tokenizes texts with the model's special tokens and batches the inputs
(engine/embed.py). `usage.prompt_tokens` (Ollama's `prompt_eval_count`) counts the tokens the
model ran, by chat's rule: a text as the tokenizer gives it with its special tokens added (the
BOS, and the EOS or SEP a BERT-style GGUF asks for) and special-token text read as such, token
ids as sent, after `truncate`. The vectors come back L2-normalised (as llama-server's and
OpenAI's; llama-server's `embd_normalize` picks another norm) as little-endian float32, which is
exactly what `encoding_format: "base64"` sends. `dimensions` is accepted only as the model's own
size: these models cannot shorten their vectors. An input over the model's limit is a 400 naming
its index ("too large"), or cut to it with `truncate: true` (Ollama's option, and here on every
route).

A model that pools none (its GGUF's pooling, or --pooling none) answers llama-server's
/embeddings with a vector per token, not normalised, as llama-server does; OpenAI's and Ollama's
routes, which have one vector per input, get the mean of them.
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, jsonify

from appliance.engine.ipc import Embed
from appliance.engine.types import Embedded

from . import serving

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 2048   # OpenAI's limit on one request's inputs
Input = str | tuple[int | str, ...]      # a text, or token ids with texts among them
# llama-server's embd_normalize: -1 none, 0 the largest magnitude scaled to int16, 1 taxicab,
# 2 Euclidean (its default and OpenAI's), p > 2 the p-norm (engine/embed.py's `normalized`)
NORMS = "-1 (none), 0 (max absolute, scaled to int16), 1 (taxicab), 2 (Euclidean) or p > 2 (p-norm)"


@dataclass(frozen=True)
class Embeddings:
    model: str          # the model that answered
    answer: Embedded
    load_s: float       # spent loading the model for this request (about 0 when it was loaded)


def embed(body: dict[str, Any], inputs: tuple[Input, ...], *, truncate: bool, dimensions: int | None = None,
          norm: int = 2, per_token: bool = False) -> Embeddings | None:
    """The vectors of `inputs` by the model `body` names (none: the model is loaded and nothing
    embedded, as Ollama does for an empty input), normalised by `norm` (NORMS); with `per_token`,
    a vector per token where the model pools none. None when the client left."""
    t0 = time.perf_counter()
    with serving.model(body, embeddings=True) as (name, engine):
        load_s = time.perf_counter() - t0
        if not inputs:
            return Embeddings(name, Embedded("", b"", 0, ()), load_s)
        stream = engine.embed(Embed(engine.new_id("embd"), inputs, truncate, dimensions, norm != -1, max(norm, 0),
                                    per_token))
    try:
        got = serving.wait(stream, serving.client_gone())
    finally:
        stream.abort()
    if got is None:
        return None
    serving.state().metrics.prompt_tokens.inc(sum(got.n_tokens))
    return Embeddings(name, got, load_s)


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_input(value: Any) -> tuple[Input, ...]:
    """The inputs of OpenAI's `input` (llama-server's `content` too): a string, token ids, or a
    list of those, as llama-server reads them: a list holding any token id is one input (ids, or
    ids and strings mixed), any other list is a list of inputs. Nothing empty."""
    serving.need(isinstance(value, (str, list)), "'input' is required: a string, a list of strings, a list of "
                 "token ids or a list of lists of token ids (token ids and strings may be mixed in one)", "input")
    items = [value] if isinstance(value, str) or any(_is_id(v) for v in value) else value
    serving.need(len(items) > 0, "'input' must not be empty", "input")
    serving.need(len(items) <= MAX_INPUTS, f"'input' has {len(items)} items; at most {MAX_INPUTS} are taken", "input")
    for i, item in enumerate(items):
        serving.need(not isinstance(item, (str, list)) or len(item) > 0, f"input[{i}] is empty", f"input[{i}]")
        ok = isinstance(item, str) or (isinstance(item, list) and all(isinstance(p, str) or _is_id(p) for p in item)
                                       and any(_is_id(p) for p in item))
        serving.need(ok, f"input[{i}] must be a string, a list of token ids, or token ids and strings mixed",
                     f"input[{i}]")
    return tuple(item if isinstance(item, str) else tuple(item) for item in items)


def _optional(body: dict[str, Any], key: str, kind: type, what: str, default: Any = None) -> Any:
    """body[key] if it is a `kind` (`default` when absent or null); a 400 naming it otherwise."""
    value = body.get(key)
    if value is None:
        return default
    serving.need(isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), f"'{key}' must be {what}", key)
    return value


def dimensions(body: dict[str, Any]) -> int | None:
    dims = _optional(body, "dimensions", int, "a positive integer")
    serving.need(dims is None or dims >= 1, "'dimensions' must be a positive integer", "dimensions")
    return dims


def embd_normalize(body: dict[str, Any]) -> int:
    """llama-server's `embd_normalize` (NORMS; 2 when absent)."""
    norm = _optional(body, "embd_normalize", int, f"an integer: {NORMS}", 2)
    serving.need(norm >= -1, f"'embd_normalize' must be {NORMS}", "embd_normalize")
    return norm


def _encoding(body: dict[str, Any]) -> str:
    encoding = _optional(body, "encoding_format", str, "\"float\" or \"base64\"", "float")
    serving.need(encoding in ("float", "base64"), "'encoding_format' must be \"float\" or \"base64\"",
                 "encoding_format")
    return encoding


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """What both dialects read beside the input: truncate, dimensions, embd_normalize."""
    _optional(body, "model", str, "a string")
    return {"truncate": _optional(body, "truncate", bool, "true or false", False), "dimensions": dimensions(body),
            "norm": embd_normalize(body)}


@bp.post("/v1/embeddings")
def embeddings():
    body = serving.read_body()
    inputs = parse_input(body.get("input"))
    encoding = _encoding(body)
    _optional(body, "user", str, "a string")
    got = embed(body, inputs, **_options(body))
    if got is None:
        return Response(status=499)  # nobody is listening
    ev = got.answer
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(ev.raw(i)).decode() if encoding == "base64" else ev.floats(i)}
            for i in range(len(ev.n_tokens))]
    n = sum(ev.n_tokens)
    return jsonify({"object": "list", "data": data, "model": got.model,
                    "usage": {"prompt_tokens": n, "total_tokens": n}})


@bp.post("/embeddings")
@bp.post("/embedding")      # llama-server's older path
def llama_server_embeddings():
    """llama-server's own: `input` or `content` (texts, token ids, both mixed) -> [{index,
    embedding}], each embedding a list of vectors: the one pooled vector, or a vector per token
    (a model that pools none)."""
    body = serving.read_body()
    value = body["input"] if "input" in body else body.get("content")
    serving.need(value is not None, "\"input\" or \"content\" must be provided", "input")
    inputs = parse_input(value)
    _encoding(body)          # checked as llama-server checks it; this shape has floats only
    got = embed(body, inputs, **_options(body), per_token=True)
    if got is None:
        return Response(status=499)
    ev = got.answer
    return jsonify([{"index": i, "embedding": ev.rows(i)} for i in range(len(ev.n_tokens))])
