"""OpenAI's /v1/embeddings, and `embed`: the one way every API embeds (Ollama's /api/embed and
/api/embeddings use it too).

The model is `pool.resolve_embedding`'s: the embedding model (--embedding-model PATH) by its
name, or for no name or an unknown one; a chat model under --embedding-model chat. The engine
tokenizes texts and batches the inputs (engine/embed.py); the vectors come back L2-normalised
(as llama-server's and OpenAI's) as little-endian float32, which is exactly what
`encoding_format: "base64"` sends. `dimensions` is accepted only as the model's own size: these
models cannot shorten their vectors. An input over the model's limit is a 400 naming its index,
or cut to it with `truncate: true` (llama-server's and Ollama's option).
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, jsonify

from appliance.engine.ipc import Embed
from appliance.engine.types import Embedded

from . import serving, wire

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 2048   # OpenAI's limit on one request's inputs
Input = str | tuple[int, ...]


@dataclass(frozen=True)
class Embeddings:
    model: str          # the model that answered
    answer: Embedded
    load_s: float       # spent loading the model for this request (about 0 when it was loaded)


def embed(body: dict[str, Any], inputs: tuple[Input, ...], *, truncate: bool, dimensions: int | None = None,
          normalize: bool = True) -> Embeddings | None:
    """The vectors of `inputs` by the model `body` names (none: the model is loaded and nothing
    embedded, as Ollama does for an empty input). None when the client left."""
    t0 = time.perf_counter()
    with serving.model(body, embeddings=True) as (name, engine):
        load_s = time.perf_counter() - t0
        if not inputs:
            return Embeddings(name, Embedded("", b"", 0, ()), load_s)
        stream = engine.embed(Embed(engine.new_id("embd"), inputs, truncate, dimensions, normalize))
    try:
        got = serving.wait(stream, serving.client_gone())
    finally:
        stream.abort()
    if got is None:
        return None
    serving.state().metrics.prompt_tokens.inc(sum(got.n_tokens))
    return Embeddings(name, got, load_s)


def parse_input(value: Any) -> tuple[Input, ...]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of lists of
    token ids (a list mixing strings and id lists too, as llama-server takes). Nothing empty."""
    serving.need(isinstance(value, (str, list)), "'input' is required: a string, a list of strings, a list of "
             "token ids or a list of lists of token ids", "input")
    items = [value] if isinstance(value, str) or (value and wire.is_ids(value)) else value
    serving.need(len(items) > 0, "'input' must not be empty", "input")
    serving.need(len(items) <= MAX_INPUTS, f"'input' has {len(items)} items; at most {MAX_INPUTS} are taken", "input")
    for i, item in enumerate(items):
        serving.need(isinstance(item, str) or wire.is_ids(item), f"input[{i}] must be a string or a list of token ids",
                 f"input[{i}]")
        serving.need(len(item) > 0, f"input[{i}] is empty", f"input[{i}]")
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


@bp.post("/v1/embeddings")
def embeddings():
    body = serving.read_body()
    inputs = parse_input(body.get("input"))
    encoding = _optional(body, "encoding_format", str, "\"float\" or \"base64\"", "float")
    serving.need(encoding in ("float", "base64"), "'encoding_format' must be \"float\" or \"base64\"", "encoding_format")
    _optional(body, "model", str, "a string")
    _optional(body, "user", str, "a string")
    truncate = _optional(body, "truncate", bool, "true or false", False)
    got = embed(body, inputs, truncate=truncate, dimensions=dimensions(body))
    if got is None:
        return Response(status=499)  # nobody is listening
    ev = got.answer
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(ev.raw(i)).decode() if encoding == "base64" else ev.floats(i)}
            for i in range(len(ev.n_tokens))]
    n = sum(ev.n_tokens)
    return jsonify({"object": "list", "data": data, "model": got.model,
                    "usage": {"prompt_tokens": n, "total_tokens": n}})
