"""The published description of the routes beside OpenAI's chat and completions (openapi.py's):
Anthropic's Messages, Ollama's, OpenAI's Responses and embeddings, llama-server's own, and the
appliance's (models, conversations, bench results, the host report).

Each API's errors are described in its own shape. Request bodies say what each route requires
and the types it checks; a field the route reads more loosely (null as absent, several forms)
is named without a type, so that the fuzz tests (test_openapi_fuzz.py: whatever a document
forbids must be a 4xx) hold the document to what the routes refuse. Replies name the fields a
client relies on.
"""
from __future__ import annotations

from typing import Any

from appliance import conversation_export
from appliance.conversations import MESSAGE_FIELDS

from . import anthropic, openai_responses
from . import openapi
from .openapi import ERROR, SSE_EVENT, TIMINGS

ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
SHAPES = {"openai": ERROR, "anthropic": ANTHROPIC_ERROR, "ollama": OLLAMA_ERROR}
POST_ERRORS = (400, 401, 403, 404, 413, 500, 503)
GET_ERRORS = (400, 401, 403, 404, 500, 503)
ANY: dict[str, Any] = {}                                  # a field read in more than one form
OBJECT = {"type": "object"}
STRING = {"type": "string"}
NAME = {"type": "string", "minLength": 1}                 # a model's name: required, not empty
FLAG = {"type": "boolean", "nullable": True}              # null: the default


def _obj(required: tuple[str, ...] = (), closed: bool = False, **props: Any) -> dict[str, Any]:
    """An object schema; `closed`: the route refuses any field not named."""
    s: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        s["required"] = list(required)
    if closed:
        s["additionalProperties"] = False
    return s


def _errors(shape: str, codes: tuple[int, ...]) -> dict[str, Any]:
    return {str(c): {"description": f"an error in {shape}'s shape",
                     "content": {"application/json": {"schema": SHAPES[shape]}}} for c in codes}


def _answer(ok: dict[str, Any], stream: str | None, status: str = "200") -> dict[str, Any]:
    content = {"application/json": {"schema": ok}}
    if stream == "sse":
        content["text/event-stream"] = {"schema": SSE_EVENT}
    elif stream == "ndjson":   # one JSON object a line
        content["application/x-ndjson"] = {"schema": OBJECT}
    return {status: {"description": "the answer" + (", or a stream when stream is true" if stream else ""),
                     "content": content}}


def post(summary: str, shape: str, body: dict[str, Any], ok: dict[str, Any], stream: str | None = None,
         status: str = "200", params: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A POST or PATCH with a JSON body; `stream`: "sse" or "ndjson" when it may answer one."""
    op = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
          "responses": {**_answer(ok, stream, status), **_errors(shape, POST_ERRORS)}}
    if params:
        op["parameters"] = list(params)
    return op


def bodiless(summary: str, shape: str, ok: dict[str, Any],
             params: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A GET or DELETE: no request body."""
    op = {"summary": summary, "responses": {**_answer(ok, None), **_errors(shape, GET_ERRORS)}}
    if params:
        op["parameters"] = list(params)
    return op


def path_param(name: str, schema: dict[str, Any] = STRING) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def query(name: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


# -- Anthropic's Messages ------------------------------------------------------------------------
def _anthropic() -> dict[str, Any]:
    fields = {name: ANY for name in sorted(anthropic.TOP_LEVEL)}
    counted = {"model": NAME, "messages": {"type": "array", "minItems": 1, "items": OBJECT},
               "metadata": {"type": "object", "nullable": True}}   # what count_tokens checks too
    typed = {**counted, "max_tokens": {"type": "integer", "minimum": 1}, "stream": FLAG,
             "stop_sequences": {"type": "array", "items": STRING, "nullable": True}}
    message = _obj(("id", "type", "role", "content", "stop_reason", "usage"),
                   type={"type": "string", "enum": ["message"]}, content={"type": "array", "items": OBJECT},
                   usage=_obj(("input_tokens", "output_tokens")), timings=TIMINGS)
    return {
        "/v1/messages": {"post": post("Anthropic's Messages: a reply", "anthropic",
                                      _obj(("model", "messages", "max_tokens"), True, **{**fields, **typed}),
                                      message, "sse")},
        "/v1/messages/count_tokens": {"post": post(
            "Anthropic's token count of a Messages request", "anthropic",
            _obj(("model", "messages"), True, **{**fields, **counted}),
            _obj(("input_tokens",), input_tokens={"type": "integer"}))},
    }


# -- Ollama's ------------------------------------------------------------------------------------
def _ollama() -> dict[str, Any]:
    # a body with nothing to answer (no messages, no prompt) loads the model whatever else it holds
    common = {"model": NAME, "stream": ANY, "options": ANY, "format": ANY, "think": ANY, "keep_alive": ANY}
    done = {"model": STRING, "created_at": STRING, "done": {"type": "boolean"}, "done_reason": STRING}
    models = _obj(("models",), models={"type": "array", "items": _obj(("name", "model"))})
    return {
        "/api/chat": {"post": post("Ollama's chat", "ollama",
                                   _obj(("model",), **common, messages=ANY, tools=ANY),
                                   _obj(("model", "created_at", "done"), **done, message=OBJECT), "ndjson")},
        "/api/generate": {"post": post("Ollama's generate", "ollama",
                                       _obj(("model",), **common, prompt=ANY, system=ANY, raw=ANY, suffix=ANY,
                                            images=ANY, context=ANY),
                                       _obj(("model", "created_at", "done"), **done, response=STRING), "ndjson")},
        "/api/embed": {"post": post("Ollama's embeddings", "ollama",
                                    _obj(("model",), model=NAME, input=ANY, truncate={"type": "boolean"},
                                         dimensions=ANY, options=ANY, keep_alive=ANY),
                                    _obj(("model", "embeddings"), embeddings={"type": "array", "items": {
                                        "type": "array", "items": {"type": "number"}}}))},
        "/api/embeddings": {"post": post("Ollama's older embedding of one prompt", "ollama",
                                         _obj(("model",), model=NAME, prompt=ANY, options=ANY, keep_alive=ANY),
                                         _obj(("embedding",), embedding={"type": "array",
                                                                         "items": {"type": "number"}}))},
        "/api/show": {"post": post("Ollama's model details", "ollama", _obj(("model",), model=NAME),
                                   _obj(("details", "capabilities"), capabilities={"type": "array", "items": STRING}))},
        "/api/tags": {"get": bodiless("Ollama's model list", "ollama", models)},
        "/api/ps": {"get": bodiless("Ollama's loaded models", "ollama", models)},
        "/api/version": {"get": bodiless("Ollama's version probe", "ollama", _obj(("version",), version=STRING))},
    }


# -- OpenAI's Responses and embeddings -----------------------------------------------------------
def _openai() -> dict[str, Any]:
    r = openai_responses
    names = sorted(r.TRANSLATED | r.ACCEPTED | set(r.EXTENSIONS) | set(r.REFUSED))
    body = _obj(("model", "input"), True, **{**{n: ANY for n in names}, "model": NAME,
                                              "instructions": {"type": "string", "nullable": True},
                                              "store": FLAG, "stream": FLAG,
                                              "max_output_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                                              "metadata": {"type": "object", "nullable": True}})
    response = _obj(("id", "object", "status", "model", "output"), id=STRING,
                    object={"type": "string", "enum": ["response"]}, status=STRING, model=STRING,
                    output={"type": "array", "items": OBJECT})
    rid = (path_param("response_id"),)
    deleted = _obj(("id", "object", "deleted"), id=STRING, object=STRING, deleted={"type": "boolean"})
    embedding = _obj(("object", "data", "model", "usage"), object={"type": "string", "enum": ["list"]},
                     data={"type": "array", "items": _obj(("object", "index", "embedding"))}, model=STRING,
                     usage=OBJECT)
    create = post("OpenAI's Responses: a reply", "openai", body, response, "sse")
    return {
        "/v1/responses": {"post": create},
        "/responses": {"post": {**create, "summary": "/v1/responses, as llama-server also answers it"}},
        "/v1/responses/{response_id}": {"get": bodiless("A stored response", "openai", response, rid),
                                        "delete": bodiless("Forget a stored response", "openai", deleted, rid)},
        "/v1/embeddings": {"post": post("Embeddings of texts or token ids", "openai",
                                        _obj(("input",), input=ANY, model=ANY, encoding_format=ANY, dimensions=ANY,
                                             user=ANY, truncate=ANY, embd_normalize=ANY), embedding)},
    }


# -- llama-server's own --------------------------------------------------------------------------
def _llama_server(chat: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    completion = post("llama-server's completion", "openai", _obj(("prompt",), prompt=ANY, stream=ANY,
                                                                   n_predict=ANY, model=ANY, logit_bias=ANY),
                      OBJECT, "sse")
    vectors = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
    embeddings = post("llama-server's embeddings: per input, its vector, or a vector per token (pooling none)",
                      "openai", _obj(input=ANY, content=ANY, model=ANY, encoding_format=ANY, embd_normalize=ANY,
                                     truncate=ANY, dimensions=ANY),
                      {"type": "array", "items": _obj(("index", "embedding"), index={"type": "integer"},
                                                      embedding=vectors)})
    return {
        "/completion": {"post": completion},
        "/embeddings": {"post": embeddings},
        "/embedding": {"post": {**embeddings, "summary": "llama-server's embeddings (its older path)"}},
        "/completions": {"post": {**completion, "summary": "llama-server's completion (its other path)"}},
        "/infill": {"post": post("llama-server's fill-in-the-middle (code models with FIM tokens)", "openai",
                                 _obj(input_prefix=ANY, input_suffix=ANY, input_extra=ANY, prompt=ANY), OBJECT, "sse")},
        "/props": {"get": bodiless("llama-server's server properties", "openai",
                              _obj(("default_generation_settings", "total_slots"), total_slots={"type": "integer"}),
                              (query("model", STRING),))},
        "/lora-adapters": {
            "get": bodiless("The model's LoRA adapters and their scales (llama-server's)", "openai",
                            {"type": "array", "items": _obj(("id", "path", "scale"))}, (query("model", STRING),)),
            "post": post("Set the scales of the requests without their own lora (an adapter not listed: 0)",
                         "openai", {"type": "array", "items": _obj(("id",), id={"type": "integer"},
                                                                  scale={"type": "number"})},
                         _obj(("success",)), params=(query("model", STRING),))},
        **_slots(),
        "/apply-template": {"post": post("A chat request's prompt as the model's template renders it", "openai",
                                         _obj(("messages",), messages={"type": "array", "items": OBJECT}),
                                         _obj(("prompt",), prompt=STRING))},
        "/chat/completions": {"post": {**chat, "summary": "/v1/chat/completions, as llama-server also answers it"}},
        "/models": {"get": {**models, "summary": "/v1/models, as llama-server also answers it"}},
    }


def _slots() -> dict[str, Any]:
    """GET /slots and the slot actions, which also answer 501 (--no-slots, no --slot-save-path)."""
    integer, model = {"type": "integer"}, query("model", STRING)
    slot = _obj(("id", "n_ctx", "speculative", "is_processing"), id=integer, n_ctx=integer,
                speculative={"type": "boolean"}, is_processing={"type": "boolean"}, id_task=integer,
                params=OBJECT, next_token={"type": "array", "items": OBJECT})
    listed = bodiless("llama-server's slots: each one's state", "openai", {"type": "array", "items": slot},
                      (model, query("fail_on_no_slot", STRING)))
    action = post("Save a slot's prompt state to a file in --slot-save-path, restore it, or erase the slot "
                  "(llama-server's)", "openai", _obj(filename=STRING), _obj(("id_slot",), id_slot=integer),
                  params=(path_param("id_slot", integer), query("action", {"type": "string", "enum": [
                      "save", "restore", "erase"]}, True), model))
    for op in (listed, action):
        op["responses"].update(_errors("openai", (501,)))
    return {"/slots": {"get": listed}, "/slots/{id_slot}": {"post": action}}


# -- the appliance's own -------------------------------------------------------------------------
def _conversations() -> dict[str, Any]:
    """The chat page's conversations: a tree of messages, a path shown, export and import."""
    summary = _obj(("id", "title"), id=STRING, title=STRING)
    conversation = _obj(("id", "title", "messages"), id=STRING, title=STRING,
                        messages={"type": "array", "items": OBJECT})
    cid = (path_param("conv_id"),)
    nullable_array = {"type": "array", "items": OBJECT, "nullable": True}
    return {
        "/api/conversations": {
            "get": bodiless("The chat page's conversations", "openai",
                       _obj(("object", "data"), data={"type": "array", "items": summary}),
                       (query("q", STRING), query("limit", {"type": "integer"}), query("offset", {"type": "integer"}))),
            "post": post("Store a new conversation", "openai",
                         _obj((), True, title=ANY, settings={"type": "object", "nullable": True},
                              messages=nullable_array), conversation, status="201")},
        "/api/conversations/{conv_id}": {
            "get": bodiless("A conversation", "openai", conversation, cid),
            "patch": post("Rename it or change its settings", "openai",
                          _obj((), True, title=ANY, settings={"type": "object", "nullable": True}), conversation,
                          params=cid),
            "delete": bodiless("Delete a conversation", "openai", _obj(("id", "deleted")), cid)},
        "/api/conversations/{conv_id}/messages": {"post": post(
            "Add messages: under a message (parent), at a position of the path shown (from: a new branch "
            "beside the one there, which is kept) or at its end", "openai",
            _obj(("messages",), True, messages={"type": "array", "items": OBJECT}, parent=ANY, **{"from": ANY}),
            conversation, params=cid)},
        "/api/conversations/{conv_id}/messages/{msg_id}": {"put": post(
            "Replace one message (a reply continued)", "openai",
            _obj(("role", "content"), True, **{k: ANY for k in MESSAGE_FIELDS}), conversation,
            params=(*cid, path_param("msg_id")))},
        "/api/conversations/{conv_id}/select": {"post": post(
            "Show the branch through a message, down to its latest leaf", "openai",
            _obj(("message_id",), True, message_id=STRING), conversation, params=cid)},
        "/api/conversations/{conv_id}/export": {"get": bodiless(
            "The conversation as a file: settings, every branch, pictures (format version 1, docs/web-app.md)",
            "openai", _obj(("format", "version", "messages")), cid)},
        "/api/conversations/import": {"post": post(
            "A new conversation from an exported file, checked whole", "openai",
            _obj(("format", "version", "messages"), True, **{k: ANY for k in conversation_export.KEYS}),
            conversation, status="201")},
        **_jobs(cid),
    }


def _appliance() -> dict[str, Any]:
    model = _obj(("model",), model=STRING)
    state = _obj(("model", "state"), model=STRING, state=STRING)
    run = (path_param("run_id", {"type": "integer"}),)
    return {
        "/api/models/load": {"post": post("Load a model of the pool", "openai", model, state)},
        "/api/models/unload": {"post": post("Unload a model of the pool", "openai", model, state)},
        "/openapi.json": {"get": bodiless("This document", "openai", _obj(("openapi", "paths")))},
        **_conversations(),
        **_tools(),
        "/api/documents": {"post": post(
            "Read a file attached in the chat page as text: framed for a message, counted in tokens", "openai",
            _obj(("name", "data"), True, name=STRING, data=STRING, model={"type": "string", "nullable": True}),
            _obj(("object", "name", "kind", "text", "content", "tokens"), name=STRING, kind=STRING, text=STRING,
                 content=STRING, tokens={"type": "integer"}))},
        "/api/bench/runs": {"get": bodiless("The stored benchmark runs", "openai",
                                       _obj(("runs",), runs={"type": "array", "items": OBJECT}))},
        "/api/bench/runs/{run_id}": {"get": bodiless("One benchmark run, its rows and series", "openai",
                                                _obj(("run", "rows")), run)},
        "/api/bench/compare": {"get": bodiless("Two benchmark runs compared", "openai", _obj(("a", "b", "rows")),
                                          tuple(query(k, {"type": "integer"}, True) for k in "ab"))},
        "/api/bench/estimate": {"post": post("Time estimate of a request from stored results", "openai",
                                             _obj(("prompt_tokens", "output_tokens"), True, prompt_tokens=ANY,
                                                  output_tokens=ANY, run_id=ANY), OBJECT)},
        "/api/host": {"get": bodiless("The host report (hardware, drivers, advice)", "openai", OBJECT,
                                 (query("refresh", STRING),))},
    }


def _tools() -> dict[str, Any]:
    """The configured MCP servers' tools (web/tools.py)."""
    array = {"type": "array", "items": OBJECT}
    result = _obj(("ok", "text", "truncated", "error", "seconds"), ok={"type": "boolean"}, text=STRING,
                  truncated={"type": "boolean"}, error={"type": "string", "nullable": True},
                  seconds={"type": "number"})
    return {"/api/tools": {"get": bodiless("The configured MCP servers, their state and their tools", "openai",
                                           _obj(("object", "servers", "data"), servers=array, data=array))},
            "/api/tools/call": {"post": post("Run one tool now, without approval (debugging)", "openai",
                                             _obj(("name",), True, name=STRING, arguments=OBJECT), result)}}


def _jobs(cid: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The chat page's replies generated by the server (web/chat_jobs.py)."""
    job = _obj(("id", "object", "conversation_id", "state", "position", "current", "steps", "pending"),
               id=STRING, object=STRING, conversation_id=STRING, state=STRING, position={"type": "integer"},
               current={"type": "integer"}, steps={"type": "integer"}, pending={"type": "array", "items": OBJECT})
    jid = (path_param("job_id"),)
    events = bodiless("Its events (SSE) from an event number on, live until it ends", "openai", job,
                      (*jid, query("from", {"type": "integer", "minimum": 0})))
    events["responses"]["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    start = _obj(("request", "position"), True, request=_obj(("messages",), messages={"type": "array", "items": OBJECT}),
                 position={"type": "integer", "minimum": 0}, **{"continue": {"type": "boolean"}})
    decision = _obj(("decision",), decision={"type": "string", "enum": ["approve", "always", "deny"]})
    return {
        "/api/conversations/{conv_id}/jobs": {"post": post(
            "Generate the conversation's reply as a job of the server", "openai", start, job, status="201",
            params=cid)},
        "/api/conversations/{conv_id}/job": {"get": bodiless("The conversation's latest job (null: none)", "openai",
                                                             {**job, "nullable": True}, cid)},
        "/api/jobs/{job_id}": {"get": bodiless("A chat job", "openai", job, jid)},
        "/api/jobs/{job_id}/events": {"get": events},
        "/api/jobs/{job_id}/stop": {"post": post("Stop a chat job", "openai", OBJECT, job, params=jid)},
        "/api/jobs/{job_id}/calls/{call_id}": {"post": post(
            "Approve or deny a tool call that waits", "openai", decision, job,
            params=(*jid, path_param("call_id")))},
    }


def paths(chat: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    """The routes beside openapi.py's; `chat` and `models` are its /v1/chat/completions POST and
    /v1/models GET, which llama-server's paths without /v1 repeat."""
    return {**_anthropic(), **_ollama(), **_openai(), **_llama_server(chat, models), **_appliance()}


def build(model: str, n_ctx: int, n_vocab: int) -> dict[str, Any]:
    """The whole /openapi.json: OpenAI's core routes (openapi.py) and every other API's."""
    return openapi.build(model, n_ctx, n_vocab, more=paths)
