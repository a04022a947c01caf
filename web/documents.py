"""POST /api/documents: a file the chat page attaches, read as text (`document_text.py`), framed
for the message it goes into and counted in the chosen model's tokens, so that the page can
check it against the context before anything is sent.

    POST /api/documents   {"name": "report.pdf", "data": "data:application/pdf;base64,...",
                           "model": null}
    -> {"object": "document", "name", "kind": "pdf" | "text", "pages", "chars", "text",
        "content" (the framed block), "tokens" (of content, in the model's tokenizer), "model"}

The file travels as a data: URI in a JSON body, as a picture does in a chat request: every /api
route reads JSON, and the one body limit (--max-body-bytes, a 413 past it) bounds it. Text files
come here too rather than being read in the browser: one place decodes charsets and says what is
wrong, and the count needs the engine's tokenizer anyway.
"""
from __future__ import annotations

import base64
import binascii
import re

from flask import Blueprint, jsonify

from appliance.errors import InvalidRequest

from . import document_text, serving

bp = Blueprint("documents", __name__)

FIELDS = ("name", "data", "model")
_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*);base64,", re.ASCII)


def parse_data_uri(url: object) -> tuple[bytes, str, str | None]:
    """(bytes, media type, charset or None) of a base64 data: URI; InvalidRequest otherwise."""
    m = _DATA_URI.match(url) if isinstance(url, str) else None
    if m is None:
        raise InvalidRequest("'data' must be a data: URI with base64 content "
                             "(data:application/pdf;base64,...)", param="data")
    params = dict(p.partition("=")[::2] for p in m["params"].split(";")[1:])
    try:
        raw = base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the base64 of 'data' does not decode", param="data") from None
    return raw, m["type"].lower(), params.get("charset") or None


def _name(body: dict) -> str:
    name = body.get("name")
    if not isinstance(name, str) or not 1 <= len(name.strip()) <= document_text.MAX_NAME:
        raise InvalidRequest(f"'name' is required: the file's name, 1 to {document_text.MAX_NAME} characters", param="name")
    return name.strip()


@bp.post("/api/documents")
def read_document():
    body = serving.read_body()
    for key in body:
        if key not in FIELDS:
            raise InvalidRequest(f"unknown field '{key}'; allowed: {', '.join(FIELDS)}", param=key)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidRequest("'model' must be a string or null", param="model")
    name = _name(body)
    raw, media_type, charset = parse_data_uri(body.get("data"))
    doc = document_text.read(name, raw, media_type, charset)
    content = document_text.frame(doc)
    with serving.model(body) as (model, engine):
        tokens = len(engine.tokenize(content, False, False, False).ids)
    return jsonify({"object": "document", "name": doc.name, "kind": doc.kind, "pages": doc.pages,
                    "chars": len(doc.text), "text": doc.text, "content": content, "tokens": tokens,
                    "model": model})
