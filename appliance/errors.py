"""Typed errors. Each maps once to an HTTP status and an OpenAI error type.

The engine raises and sends these across the process boundary as (kind, message, fields);
`from_wire` rebuilds the same class on the server side, so no code ever matches on message text.
"""
from __future__ import annotations

from typing import Any


class ApplianceError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    llama_type: str | None = None   # llama-server's type where it has its own: its routes answer that one

    def __init__(self, message: str, *, param: str | None = None, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.fields = fields

    def to_wire(self) -> tuple[str, str, dict[str, Any]]:
        return type(self).__name__, self.message, {"param": self.param, **self.fields}

    def body(self, llama: bool = False) -> dict[str, Any]:
        """The OpenAI error body; `llama`: with llama-server's type, for a route of its API."""
        kind = self.llama_type if llama and self.llama_type else self.type
        err = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        err.update(self.fields)
        return {"error": err}


class InvalidRequest(ApplianceError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class ContextOverflow(InvalidRequest):
    """The prompt plus max_tokens does not fit the per-slot context."""

    code = "context_length_exceeded"
    llama_type = "exceed_context_size_error"


class InvalidToken(InvalidRequest):
    code = "invalid_token"


class Unauthorized(ApplianceError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ApplianceError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ApplianceError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ApplianceError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class Conflict(ApplianceError):
    """The request clashes with the state of what it names (a second chat job for one conversation)."""

    status, type, code = 409, "invalid_request_error", "conflict"


class PayloadTooLarge(ApplianceError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class NotSupported(ApplianceError):
    """A route this server answers only when started with a flag (llama-server's 501)."""

    status, type, code = 501, "not_supported_error", "not_supported"


class QueueFull(ApplianceError):
    """Every slot is busy and the wait queue is full: try again later."""

    status, type, code = 503, "server_overloaded", "queue_full"


class EngineUnavailable(ApplianceError):
    """The engine is loading, restarting or shutting down."""

    status, type, code = 503, "server_unavailable", "engine_unavailable"


class EngineCrashed(ApplianceError):
    """The engine process died while the request was in flight."""

    status, type, code = 503, "server_error", "engine_crashed"


class EngineFailure(ApplianceError):
    """The engine hit an internal error on this request."""

    status, type, code = 500, "server_error", "engine_error"


class ModelLoadError(ApplianceError):
    status, type, code = 500, "server_error", "model_load_failed"


_BY_NAME = {cls.__name__: cls for cls in (
    ApplianceError, InvalidRequest, ContextOverflow, InvalidToken, Unauthorized, Forbidden, NotFound,
    ModelNotFound, MethodNotAllowed, Conflict, PayloadTooLarge, NotSupported, QueueFull,
    EngineUnavailable, EngineCrashed, EngineFailure, ModelLoadError)}


def from_wire(kind: str, message: str, fields: dict[str, Any]) -> ApplianceError:
    cls = _BY_NAME.get(kind, EngineFailure)
    fields = dict(fields)
    param = fields.pop("param", None)
    return cls(message, param=param, **fields)
