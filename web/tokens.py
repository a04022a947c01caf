"""llama-server's /tokenize and /detokenize: their bodies read, the model's tokenizer asked in
its engine process, and the replies in llama-server's shape (pieces as text, or as bytes where a
token holds part of a character)."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from appliance.engine.types import Tokenized
from appliance.errors import InvalidRequest

from . import serving
from .params import TOKENIZE
from .prompts import is_ids

bp = Blueprint("tokens", __name__)


def parse_tokenize(body: dict) -> tuple[str, bool, bool, bool]:
    """llama-server's /tokenize body: (content, add_special, parse_special, with_pieces)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidRequest("'content' is required and must be a string", param="content")
    t = TOKENIZE
    return content, t["add_special"].read(body), t["parse_special"].read(body), t["with_pieces"].read(body)


def parse_detokenize(body: dict) -> tuple[int, ...]:
    """llama-server's /detokenize body: the token ids (checked against the vocabulary by the engine)."""
    tokens = body.get("tokens")
    if not is_ids(tokens):
        raise InvalidRequest("'tokens' is required and must be a list of token ids", param="tokens")
    return tuple(tokens)


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a multi-byte character: its bytes, as llama-server gives them
        return list(raw)


def tokenize_response(ev: Tokenized, with_pieces: bool) -> dict[str, Any]:
    if not with_pieces:
        return {"tokens": list(ev.ids)}
    return {"tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(ev.ids, ev.pieces)]}


@bp.post("/tokenize")
def tokenize():
    body = serving.read_body()
    content, add_special, parse_special, with_pieces = parse_tokenize(body)
    with serving.model(body) as (_, engine):
        ev = engine.tokenize(content, add_special, parse_special, with_pieces)
    return jsonify(tokenize_response(ev, with_pieces))


@bp.post("/detokenize")
def detokenize():
    body = serving.read_body()
    ids = parse_detokenize(body)
    with serving.model(body) as (_, engine):
        return jsonify({"content": engine.detokenize(ids).text})
