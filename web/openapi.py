"""The published description of the API (OpenAPI 3.0), served at /openapi.json.

It says what `wire.py` accepts. The scalar request parameters are rendered from their
declarations in `params.py` (the same ones wire validates with: type, range or choices,
default, help as the description); the structured ones are written here with the limits
params.py names. The fuzz tests (schemathesis) hold document and server together: whatever
this document forbids must be a 4xx, and no input may produce a 5xx. Every other route of the
app but the pages is described by openapi_apis.py, each API's errors in its own shape (a test
holds the document to the app's URL map).
"""
from __future__ import annotations

from typing import Any, Callable

from appliance import __version__

from . import params
from .params import Param
from .prompts import MAX_PROMPTS


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def scalar(p: Param, n_ctx: int) -> dict[str, Any]:
    """The schema of one declared parameter; null is always allowed (it means the default)."""
    s: dict[str, Any] = {"type": p.kind, "description": p.help}
    lo, hi = p.bounds(n_ctx)
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    if p.enum:
        s["enum"] = list(p.enum)
    if p.default is not None:
        s["default"] = p.default
    return _nullable(s)


def _scalars(table: dict[str, Param], n_ctx: int) -> dict[str, Any]:
    return {name: scalar(p, n_ctx) for name, p in table.items()}


def _structured(model: str) -> dict[str, Any]:
    """The parameters with structure that both endpoints take."""
    stop = _nullable({"oneOf": [{"type": "string"},
                                {"type": "array", "items": {"type": "string"}, "maxItems": params.MAX_STOPS}]})
    return {
        "model": {"type": "string", "enum": [model]},
        "stop": stop,
        "logit_bias": _nullable({"type": "object", "description": "token id (a string of digits) -> bias added "
                                 "to its logit; -100 bans the token", "maxProperties": params.MAX_LOGIT_BIAS,
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "stream_options": _nullable({"type": "object", "properties": _scalars(params.STREAM_OPTIONS, 0)}),
        "response_format": _nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": list(params.RESPONSE_FORMATS)},
            "json_schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "strict": _nullable({"type": "boolean"}),
                "schema": {"type": "object"}}}}}),
    }


def _message() -> dict[str, Any]:
    text = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    image = {"type": "object", "required": ["type", "image_url"], "description": "a picture, for a model served "
             "with --mmproj: a data: URI (an http(s) URL with --image-urls)", "properties": {
                 "type": {"type": "string", "enum": ["image_url"]},
                 "image_url": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}}}
    part = {"oneOf": [text, image]}
    return {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": list(params.ROLES)},
        "content": _nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}),
        "name": _nullable({"type": "string"}),
        "tool_calls": _nullable({"type": "array", "items": REQUEST_TOOL_CALL}),
        "tool_call_id": _nullable({"type": "string"}),
    }}


USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
TIMINGS = {"type": "object", "required": ["prompt_n", "prompt_ms", "predicted_n", "predicted_ms"],
           "properties": {k: {"type": "number"} for k in (
               "prompt_n", "cache_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
               "predicted_per_second", "queue_ms", "tokens_per_step", "n_ctx", "depth")}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}
FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
REQUEST_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"oneOf": [{"type": "string"}, {"type": "object"}]}}}}}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": params.TOOL_NAME_PATTERN},
        "description": {"type": "string"}, "parameters": {"type": "object"}}}}}
TOOL_CHOICE = _nullable({"oneOf": [
    {"type": "string", "enum": list(params.TOOL_CHOICES)},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]})
CHAT_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                 "properties": {
                     "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
                     "created": {"type": "integer"}, "model": {"type": "string"},
                     "choices": {"type": "array", "items": {"type": "object", "properties": {
                         "index": {"type": "integer"}, "finish_reason": FINISH,
                         "message": {"type": "object", "required": ["role", "content"], "properties": {
                             "role": {"type": "string", "enum": ["assistant"]},
                             "content": {"type": "string", "nullable": True},
                             "tool_calls": {"type": "array", "items": TOOL_CALL}}},
                         "logprobs": {"type": "object", "nullable": True}}}},
                     "usage": USAGE, "timings": TIMINGS}}
COMPLETION_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {
                           "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": {"type": "object", "properties": {
                               "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": FINISH,
                               "logprobs": {"type": "object", "nullable": True}}}},
                           "usage": USAGE, "timings": TIMINGS}}
# one server-sent event as schemathesis reads it; `data` is a JSON chunk or [DONE]
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
MODEL = {"type": "object", "required": ["id", "object"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
    "context_length": {"type": "integer"}, "owned_by": {"type": "string"},
    # llama-server's: every --model-alias name, and --tags
    "aliases": {"type": "array", "items": {"type": "string"}}, "tags": {"type": "array", "items": {"type": "string"}}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "an OpenAI-shaped error",
                     "content": {"application/json": {"schema": ERROR}}} for c in codes}


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    if stream:
        answer = {"description": "the completion, or an SSE stream when stream is true",
                  "content": {"application/json": {"schema": ok}, "text/event-stream": {"schema": SSE_EVENT}}}
    else:
        answer = {"description": "the answer", "content": {"application/json": {"schema": ok}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": answer, **_errors(400, 401, 403, *([404] if stream else []), 413, 500, 503)}}}


def _tokenizer(n_vocab: int) -> dict[str, Any]:
    """llama-server's /tokenize and /detokenize."""
    tokenize_body = {"type": "object", "required": ["content"], "properties": {
        "content": {"type": "string"}, **_scalars(params.TOKENIZE, 0)}}
    # a piece that is not valid UTF-8 on its own comes as its bytes
    piece = {"oneOf": [{"type": "string"},
                       {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}]}
    with_piece = {"type": "object", "required": ["id", "piece"],
                  "properties": {"id": {"type": "integer"}, "piece": piece}}
    tokens = {"type": "object", "required": ["tokens"], "properties": {"tokens": {
        "type": "array", "items": {"oneOf": [{"type": "integer"}, with_piece]}}}}
    detokenize_body = {"type": "object", "required": ["tokens"], "properties": {"tokens": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": n_vocab - 1}}}}
    content = {"type": "object", "required": ["content"], "properties": {"content": {"type": "string"}}}
    return {"/tokenize": _post("Text to token ids (llama-server's)", tokenize_body, tokens, stream=False),
            "/detokenize": _post("Token ids to text (llama-server's)", detokenize_body, content, stream=False)}


def _health() -> dict[str, Any]:
    return {"description": "engine state", "content": {"application/json": {"schema": {
        "type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"},
            "exposed": {"type": "boolean", "description": "the network gets everything: no API key on a "
                                                          "non-loopback address"},
            "warnings": {"type": "array", "items": {"type": "string"}}}}}}}


def _models() -> dict[str, Any]:
    return {"get": {"summary": "The served model", "responses": {
        "200": {"description": "a list of one model", "content": {"application/json": {"schema": {
            "type": "object", "required": ["object", "data"], "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": MODEL}}}}}},
        **_errors(401, 403, 503)}}}


def _generation(model: str, n_ctx: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat and completion request bodies."""
    chat_body = {"type": "object", "required": ["messages"], "properties": {
        **_scalars(params.CHAT, n_ctx), **_structured(model),
        "messages": {"type": "array", "minItems": 1, "items": _message()},
        "chat_template_kwargs": _nullable({"type": "object"}),
        "tools": _nullable({"type": "array", "items": TOOL}), "tool_choice": TOOL_CHOICE,
    }}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    # a list of prompts (strings or token-id lists) is a batch: a choice per prompt (prompts.py)
    prompt = {"oneOf": [{"type": "string"}, ids, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                                   "items": {"oneOf": [{"type": "string"}, ids]}}]}
    completion_body = {"type": "object", "required": ["prompt"], "properties": {
        **_scalars(params.COMPLETION, n_ctx), **_structured(model), "prompt": prompt}}
    return chat_body, completion_body


def build(model: str, n_ctx: int, n_vocab: int,
          more: Callable[[dict, dict], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The document of OpenAI's core routes; `more(chat_post, models_get)` adds the other APIs'
    paths (openapi_apis.build passes them: that module builds on this one's schemas)."""
    chat_body, completion_body = _generation(model, n_ctx)
    health, models = _health(), _models()
    chat = _post("Chat completion", chat_body, CHAT_RESPONSE)
    return {
        "openapi": "3.0.3",
        "info": {"title": "appliance", "version": __version__,
                 "description": "A local LLM serving appliance: OpenAI's API (chat, completions, Responses, "
                                "embeddings), Anthropic's Messages, Ollama's and llama-server's."},
        "paths": {
            "/v1/chat/completions": chat,
            "/v1/completions": _post("Text completion", completion_body, COMPLETION_RESPONSE),
            "/v1/models": models,
            "/v1/models/{model}": {"get": {
                "summary": "One model", "parameters": [{"name": "model", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {
                    "application/json": {"schema": MODEL}}}, **_errors(401, 403, 404, 503)}}},
            "/health": {"get": {"summary": "Engine health", "responses": {"200": health, "503": health,
                                                                          **_errors(401, 403)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401, 403)}}},
            **_tokenizer(n_vocab),
            **(more(chat["post"], models["get"]) if more else {}),
        },
    }
