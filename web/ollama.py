"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`), for the front-ends and editor plugins that speak it natively, translated to
and from the OpenAI requests the rest of the server serves (one validation, one engine).

`options` map to sampling (temperature, top_p, top_k, min_p, seed, num_predict, stop,
repeat_penalty, presence_penalty, frequency_penalty); the options that configure Ollama's own
runner (num_ctx, num_gpu, num_thread, ...) are accepted and have no effect: this server's
context and placement are set at start. `format` ("json" or a JSON schema) is the same
structured output, `think` the template's thinking switch, `keep_alive` the pool's. Streams are
NDJSON, one object a line, the last with `done: true` and the durations (nanoseconds).
Errors are Ollama's shape, `{"error": "..."}`. `/api/embed` and the older `/api/embeddings` go
through `embeddings.embed`, as OpenAI's /v1/embeddings does.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

from flask import Blueprint, Response, g, jsonify
from werkzeug.exceptions import HTTPException

from appliance import __version__, jsondepth
from appliance.engine.types import IMAGE_MARKER, Delta, Done
from appliance.errors import ApplianceError, InvalidRequest

from . import embeddings, images, serving
from .reasoning import reasoning_kwargs

bp = Blueprint("ollama", __name__)

# the Ollama release whose API this server speaks: chat with tools and thinking, embed, show, ps,
# and OpenAI's Responses API (0.13.4) for Codex's --oss mode
OLLAMA_VERSION = "0.13.5"
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "repeat_last_n": "repeat_last_n", "typical_p": "typical_p",
            "mirostat": "mirostat", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
# the load's options (one model serves every request as loaded); tfs_z (tail-free sampling, which
# llama.cpp no longer has) and penalize_newline, which Ollama no longer applies
RUNNER_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
                  "num_keep", "low_vram", "f16_kv", "vocab_only", "tfs_z", "penalize_newline"}


@bp.errorhandler(ApplianceError)
def _ollama_error(e: ApplianceError):
    return jsonify({"error": e.message}), e.status


@bp.errorhandler(HTTPException)
def _ollama_http_error(e: HTTPException):
    return jsonify({"error": e.description or e.name}), e.code or 500


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _need(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


# -- request: Ollama -> OpenAI ------------------------------------------------------------------
def _options(body: dict[str, Any], oai: dict[str, Any]) -> None:
    options = body.get("options") or {}
    _need(isinstance(options, dict), "'options' must be an object", "options")
    for name, value in options.items():
        if name in SAMPLING:
            oai[SAMPLING[name]] = value
        elif name == "num_predict":
            _need(isinstance(value, int) and not isinstance(value, bool), "options.num_predict must be an integer",
                  "options.num_predict")
            if value > 0:             # -1 (no limit) and -2 (fill the context): up to the context
                oai["max_tokens"] = value
        elif name not in RUNNER_OPTIONS:
            raise InvalidRequest(f"unknown option '{name}'", param=f"options.{name}")


def _format(body: dict[str, Any], oai: dict[str, Any]) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        oai["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        oai["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    else:
        raise InvalidRequest("'format' must be \"json\" or a JSON schema object", param="format")


def _common(body: dict[str, Any], model: str, stream_default: bool = True) -> dict[str, Any]:
    stream = body.get("stream", stream_default)
    _need(isinstance(stream, bool), "'stream' must be true or false", "stream")
    oai: dict[str, Any] = {"model": model, "stream": stream}
    if stream:
        oai["stream_options"] = {"include_usage": True}
    if body.get("keep_alive") is not None:
        oai["keep_alive"] = body["keep_alive"]
    think = body.get("think")
    if think is not None:
        _need(isinstance(think, bool) or think in ("low", "medium", "high"), "'think' must be true or false", "think")
        oai["chat_template_kwargs"] = reasoning_kwargs(think, "think") if isinstance(think, str) else \
            {"enable_thinking": think}
    # Ollama 0.12's logprobs: not written in Ollama's shape yet (/v1/chat/completions has them)
    for name in ("logprobs", "top_logprobs"):
        _need(not body.get(name), f"'{name}' is not supported on Ollama's routes by this server "
              "(ask /v1/chat/completions for logprobs)", name)
    _options(body, oai)
    _format(body, oai)
    return oai


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls get ids (Ollama's have none), and each tool
    result answers the oldest call not answered yet."""
    _need(isinstance(messages, list), "'messages' must be a list", "messages")
    out, pending, n = [], [], 0
    for i, m in enumerate(messages):
        _need(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool"),
              f"messages[{i}].role must be system, user, assistant or tool", f"messages[{i}].role")
        msg: dict[str, Any] = {"role": m["role"], "content": _with_images(m.get("content") or "", m.get("images"),
                                                                          f"messages[{i}].images")}
        if m["role"] == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning_content"] = m["thinking"]   # earlier reasoning, for templates that keep it
        calls = m.get("tool_calls") or []
        _need(isinstance(calls, list), f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        if calls:
            msg["tool_calls"] = []
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                n += 1
                msg["tool_calls"].append({"id": f"call_{n}", "type": "function", "function": {
                    "name": fn.get("name", ""), "arguments": json.dumps(fn.get("arguments") or {})}})
                pending.append(f"call_{n}")
        if m["role"] == "tool":
            msg["tool_call_id"] = pending.pop(0) if pending else f"call_{n + 1}"
        out.append(msg)
    return out


def chat_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    oai = _common(body, model)
    oai["messages"] = _chat_messages(body.get("messages"))
    if body.get("tools"):
        oai["tools"] = body["tools"]
    return oai


def generate_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The OpenAI body: a raw prompt is a completion, else a chat turn through the template."""
    for name, what in (("suffix", "fill-in-the-middle"), ("context", "'context' (deprecated)")):
        _need(not body.get(name), f"{what} is not supported by this server", name)
    prompt = body.get("prompt", "")
    _need(isinstance(prompt, str), "'prompt' must be a string", "prompt")
    oai = _common(body, model)
    content = _with_images(prompt, body.get("images"), "images")
    if body.get("raw"):   # the pictures first, as llama-server's multimodal prompt
        oai["prompt"] = prompt if isinstance(content, str) else {
            "prompt_string": IMAGE_MARKER * len(body["images"]) + prompt, "multimodal_data": body["images"]}
        oai.pop("chat_template_kwargs", None)
        return oai
    system = body.get("system")
    oai["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return oai


def _with_images(text: Any, pictures: Any, where: str) -> Any:
    """A message's content with Ollama's `images` (base64, no data: prefix): OpenAI's parts,
    the pictures before the text; the text alone when there are none."""
    if not pictures:
        return text
    _need(isinstance(pictures, list) and all(isinstance(p, str) for p in pictures),
          f"'{where}' must be a list of base64 strings", where)
    parts = [images.image_url_part(images.data_url("image/*", p)) for p in pictures]
    return [*parts, {"type": "text", "text": text if isinstance(text, str) else ""}]


# -- response: engine events -> Ollama ----------------------------------------------------------
def _stats(done: Done) -> dict[str, Any]:
    t, u = done.timings, done.usage
    ns = lambda ms: int(ms * 1_000_000)  # noqa: E731
    reason = {"length": "length", "tool_calls": "stop", "cancelled": "stop"}.get(done.finish_reason, "stop")
    return {"done": True, "done_reason": reason, "total_duration": ns(t.queue_ms + t.prompt_ms + t.predicted_ms),
            "load_duration": 0, "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": ns(t.prompt_ms),
            "eval_count": u.completion_tokens, "eval_duration": ns(t.predicted_ms)}


def _calls(deltas: list[Delta]) -> list[dict[str, Any]]:
    out = []
    for c in (c for d in deltas for c in d.tool_calls):
        try:
            args = jsondepth.loads(c.arguments) if c.arguments else {}
        except ValueError:     # a call cut off, or nested too deep: its text as the model wrote it
            args = {"_raw": c.arguments}
        out.append({"function": {"name": c.name, "arguments": args}})
    return out


def _piece(model: str, chat: bool, deltas: list[Delta]) -> dict[str, Any]:
    text, thinking = "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas)
    if chat:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        calls = _calls(deltas)
        if calls:
            msg["tool_calls"] = calls
        return {"model": model, "created_at": _now(), "message": msg}
    out = {"model": model, "created_at": _now(), "response": text}
    if thinking:
        out["thinking"] = thinking
    return out


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class LineWriter:
    """Ollama's NDJSON stream for one reply: a line a piece of text, thinking or a whole call,
    the last line with `done: true` and the durations; an error is an `{"error": ...}` line."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat

    def start(self) -> bytes:
        return b""

    def delta(self, ev: Delta) -> bytes:
        if not (ev.text or ev.reasoning or ev.tool_calls):   # Ollama sends a call whole, once complete
            return b""
        return _line({**_piece(self.model, self.chat, [ev]), "done": False})

    def end(self, done: Done) -> bytes:
        return _line({**_piece(self.model, self.chat, []), **_stats(done)})

    @staticmethod
    def error(e: ApplianceError) -> bytes:
        return _line({"error": e.message})

    @staticmethod
    def idle() -> bytes:
        return b""                  # NDJSON has no comment line: the client waits in silence


def _serve(oai: dict[str, Any], model: str, chat: bool):
    """Submit and answer in /api/chat's shape (`chat`) or /api/generate's."""
    # num_predict is a ceiling, as Ollama's: past the context's end the reply stops there
    sub = serving.parse_submit(oai, chat="messages" in oai, adjust=serving.ceiling(oai.pop("max_tokens", None)))
    return serving.reply(sub, lambda: LineWriter(model, chat),
                         lambda deltas, done: {**_piece(model, chat, deltas), **_stats(done)}, serving.NDJSON)


def _loaded_only(body: dict[str, Any], model: str, chat: bool):
    """A request with nothing to answer loads (or, keep_alive 0, unloads) the model, as Ollama's do."""
    with serving.model(body):
        pass
    reason = "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
    empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return jsonify({"model": model, "created_at": _now(), **empty, "done": True, "done_reason": reason})


@bp.post("/api/chat")
def chat():
    body = serving.read_body()
    model = _model_name(body)
    if not body.get("messages"):
        return _loaded_only(body, model, chat=True)
    return _serve(chat_body(body, model), model, chat=True)


@bp.post("/api/generate")
def generate():
    body = serving.read_body()
    model = _model_name(body)
    if not body.get("prompt") and not body.get("raw"):
        return _loaded_only(body, model, chat=False)
    return _serve(generate_body(body, model), model, chat=False)


def _model_name(body: dict[str, Any]) -> str:
    """A served model's name, exactly: Ollama answers 404 for any other (its clients pull then)."""
    model = body.get("model")
    _need(isinstance(model, str) and model != "", "'model' is required", "model")
    return serving.pool().resolve(model.removesuffix(":latest"), exact=True)


# -- embeddings ---------------------------------------------------------------------------------
def _embed(body: dict[str, Any], inputs: tuple[str, ...], truncate: bool,
           normalize: bool = True) -> embeddings.Embeddings | None:
    """`inputs` embedded by the model `body` names exactly (a chat model's is a 400 unless it embeds)."""
    _need(isinstance(body.get("options") or {}, dict), "'options' must be an object", "options")
    _need(isinstance(truncate, bool), "'truncate' must be true or false", "truncate")
    return embeddings.embed({**body, "model": _model_name(body)}, inputs, truncate=truncate,
                            dimensions=embeddings.dimensions(body), norm=2 if normalize else -1)


@bp.post("/api/embed")
def embed():
    """{model, input: text or texts, truncate (default true), dimensions, options, keep_alive}: the
    L2-normalised vectors; an empty input loads the model and embeds nothing, as Ollama does."""
    body = serving.read_body()
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts] if texts else []
    _need(texts is None or (isinstance(texts, list) and all(isinstance(t, str) for t in texts)),
          "'input' must be a string or a list of strings", "input")
    got = _embed(body, tuple(texts or ()), body.get("truncate", True))
    if got is None:
        return Response(status=499)
    ev = got.answer
    return jsonify({"model": got.model, "embeddings": [ev.floats(i) for i in range(len(ev.n_tokens))],
                    "total_duration": int((time.perf_counter() - g.t0) * 1e9), "load_duration": int(got.load_s * 1e9),
                    "prompt_eval_count": sum(ev.n_tokens)})


@bp.post("/api/embeddings")
def embeddings_legacy():
    """Ollama's older {model, prompt} -> {embedding}: one vector, not normalised (as Ollama's)."""
    body = serving.read_body()
    prompt = body.get("prompt") or ""
    _need(isinstance(prompt, str), "'prompt' must be a string", "prompt")
    got = _embed(body, (prompt,) if prompt else (), True, normalize=False)
    if got is None:
        return Response(status=499)
    return jsonify({"embedding": got.answer.floats(0) if prompt else []})


# -- the model list -----------------------------------------------------------------------------
def _details(path: str) -> dict[str, Any]:
    from appliance.fit.gguf_header import read_header
    from appliance.library.card import card_of, human_params

    try:
        card = card_of(*read_header(path))
    except (OSError, ValueError):
        return {"format": "gguf", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}
    return {"parent_model": "", "format": "gguf", "family": card.arch, "families": [card.arch],
            "parameter_size": human_params(card.n_params), "quantization_level": card.quant}


def _tag(row: dict[str, Any]) -> dict[str, Any]:
    path = row["path"]
    try:
        st = os.stat(path)
        size, modified = st.st_size, datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).isoformat()
    except OSError:
        size, modified = 0, _now()
    return {"name": row["name"], "model": row["name"], "modified_at": modified, "size": size,
            "digest": "", "details": _details(path)}


@bp.get("/api/tags")
def tags():
    return jsonify({"models": [_tag(row) for row in serving.pool().status()]})


@bp.get("/api/ps")
def ps():
    rows = [r for r in serving.pool().status() if r["state"] == "loaded"]
    return jsonify({"models": [{**_tag(r), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                                "context_length": r.get("n_ctx", 0)} for r in rows]})


@bp.post("/api/show")
def show():
    body = serving.read_body()
    name = _model_name(body)
    row = next(r for r in serving.pool().status() if r["name"] == name)
    engine = serving.pool().client(name)
    info = engine.info if engine is not None else None
    out = {"modelfile": "", "parameters": "", "template": (info.chat_template or "") if info else "",
           "details": _details(row["path"]), "model_info": {"general.architecture": info.arch} if info else {},
           "capabilities": ["completion"] + (["tools"] if info and info.chat_template and "tools" in info.chat_template else [])
           + (["vision"] if info and "mmproj" in info.settings else [])}
    if info is not None:
        out["model_info"][f"{info.arch}.context_length"] = info.n_ctx_train
    return jsonify(out)


@bp.get("/api/version")
def version():
    """The Ollama API version whose features this server answers (clients gate on it: Codex's
    --oss mode needs 0.13.4, the first with /v1/responses), and the appliance's own beside it."""
    return jsonify({"version": OLLAMA_VERSION, "appliance": __version__})

