"""Typed errors as HTTP responses: the app's one mapping (web/__init__.py registers it), in
OpenAI's shape, with llama-server's type on its routes (llamaserver.py's handler); Anthropic's and
Ollama's blueprints render theirs in their own shapes. A werkzeug HTTP error and an exception
nobody expected become typed errors first, so they take the same path."""
from __future__ import annotations

import logging
from typing import Any

from flask import current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from appliance.errors import (ApplianceError, EngineFailure, InvalidRequest, MethodNotAllowed, NotFound,
                              PayloadTooLarge, QueueFull)

log = logging.getLogger("appliance.web")


def error_response(e: ApplianceError, llama: bool = False) -> tuple[Any, int, dict[str, str]]:
    """The typed error as its HTTP status and OpenAI's body (`llama`: with llama-server's type
    where it has its own, for its routes: llamaserver.py's handler)."""
    headers = {}
    if isinstance(e, QueueFull) or e.status == 503:
        headers["Retry-After"] = str(e.fields.get("retry_after", 1))
    if e.status >= 500:
        log.warning("%s %s -> %d %s", request.method, request.path, e.status, e.message)
    return jsonify(e.body(llama)), e.status, headers


def http_error(e: HTTPException):
    mapped = {404: NotFound(f"no route for {request.method} {request.path}"),
              405: MethodNotAllowed(f"{request.method} is not allowed on {request.path}"),
              413: PayloadTooLarge(f"the request body is larger than the server accepts "
                                   f"({current_app.config['MAX_CONTENT_LENGTH']:,} bytes, --max-body-bytes)",
                                   max_body_bytes=current_app.config["MAX_CONTENT_LENGTH"])}
    code = e.code or 500
    if code in mapped:
        err = mapped[code]
    elif code >= 500:   # a server-side failure stays one, in the error shape
        err = EngineFailure(e.description or e.name)
    else:
        err = InvalidRequest(e.description or e.name)
    if code not in mapped:
        err.status = code
    return error_response(err)


def unexpected(e: Exception):
    log.exception("unhandled error on %s %s", request.method, request.path)
    # handled as the typed error it becomes, so that the route's API answers in its own shape
    # (Anthropic's and Ollama's blueprints render ApplianceError themselves), as for a 4xx
    return current_app.handle_user_exception(EngineFailure("internal server error"))
