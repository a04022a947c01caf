"""The OpenAI wire format <-> engine types. Validation lives here, once, for both endpoints.

Every client mistake becomes an `InvalidRequest` naming the offending parameter, so the API
answers a 400 (never a 500, which SDKs retry) and nothing reaches the engine. Parameters this
version does not implement yet (tools, structured output, logprobs) are refused by name rather
than silently ignored.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import dataclasses

import re

from appliance.engine.types import (ChatMessage, Constraint, Delta, Done, Request, SamplingParams, TokenLogprob,
                                    Tokenized, ToolCall, ToolSpec)
from appliance.errors import InvalidRequest, ModelNotFound, UnsupportedMediaType

SPECULATE_MODES = ("off", "lookup", "draft")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
# accepted and ignored: they change nothing for a single local model
IGNORED = {"user", "store", "metadata", "service_tier",
           "prediction", "modalities", "audio", "reasoning_effort", "n_probs", "id_slot"}
NOT_YET = {"functions": "the deprecated 'functions' (use 'tools')", "function_call": "the deprecated 'function_call'",
           "logit_bias": "logit_bias",
           "grammar": "grammars", "json_schema": "structured output", "best_of": "best_of",
           "echo": "echo", "suffix": "suffix"}


@dataclass(frozen=True)
class ParsedRequest:
    request: Request
    stream: bool
    include_usage: bool
    model: str


def parse_json_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("the body must be JSON: send 'Content-Type: application/json'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {type(body).__name__}")
    try:  # JSON's \ud800-style escapes can smuggle lone surrogates, which are not text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the body contains an unpaired UTF-16 surrogate escape (not valid Unicode)") from None
    return body


# -- typed getters ------------------------------------------------------------------------------

def _num(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{key}' must be between {lo} and {hi}, got {v}", param=key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{key}' must be an integer", param=key)
    if v < lo or (hi is not None and v > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequest(f"'{key}' must be {bound}, got {v}", param=key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{key}' must be true or false", param=key)
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    if len(v) > MAX_STOPS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOPS} strings", param="stop")
    return tuple(s for s in v if s)


def _refuse_unsupported(body: dict) -> None:
    for key, what in NOT_YET.items():
        v = body.get(key)
        if v in (None, False, [], {}):
            continue
        raise InvalidRequest(f"'{key}' ({what}) is not supported by this server version", param=key)
    n = body.get("n")
    if n is not None and n != 1:  # null means the default, as for every other parameter
        raise InvalidRequest("only n=1 is supported", param="n")


def check_model(body: dict, served: set[str]) -> str:
    model = body.get("model")
    if model is None:
        return next(iter(sorted(served)))
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    if model not in served:
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves "
                            f"{', '.join(sorted(served))}", param="model")
    return model


def sampling_params(body: dict, n_ctx: int, default_max_tokens: int | None) -> SamplingParams:
    max_tokens = _int(body, "max_completion_tokens", 1, n_ctx, None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, n_ctx, default_max_tokens)
    return SamplingParams(
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0),
        top_k=_int(body, "top_k", 0, None, 0),
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 0.01, 10.0,
                                _num(body, "repeat_penalty", 0.01, 10.0, 1.0)),
        seed=_int(body, "seed", -(2**63), 2**64 - 1, None),
        max_tokens=max_tokens, stop=_stops(body),
        ignore_eos=_bool(body, "ignore_eos", False),
    )


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return stream, _bool(opts, "include_usage", False)


def response_format(body: dict) -> Constraint | None:
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest("'response_format' must be an object with a 'type'", param="response_format")
    kind = rf["type"]
    js = rf.get("json_schema")
    if js is not None:
        if not isinstance(js, dict):
            raise InvalidRequest("response_format.json_schema must be an object", param="response_format.json_schema")
        if not isinstance(js.get("name", ""), str):
            raise InvalidRequest("response_format.json_schema.name must be a string",
                                 param="response_format.json_schema.name")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise InvalidRequest("response_format.json_schema.strict must be true or false",
                                 param="response_format.json_schema.strict")
        if "schema" in js and not isinstance(js["schema"], dict):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                 param="response_format.json_schema.schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise InvalidRequest(f"response_format type must be text, json_object or json_schema; got {kind!r}",
                             param="response_format.type")
    if js is None:
        raise InvalidRequest("response_format.json_schema (with a 'schema') is required for type json_schema",
                             param="response_format.json_schema")
    return Constraint("json_schema", json.dumps(js.get("schema", {}), sort_keys=True))


TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tools(body: dict) -> tuple[ToolSpec, ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -",
                                 param=f"tools[{i}].function.name")
        if name in seen:
            raise InvalidRequest(f"tools[{i}]: the function name {name!r} is given twice", param=f"tools[{i}]")
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                                 param=f"tools[{i}].function.parameters")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string",
                                 param=f"tools[{i}].function.description")
        seen.add(name)
        out.append(ToolSpec(name, desc, json.dumps(params, sort_keys=True)))
    return tuple(out)


def _tool_choice(body: dict, tools: tuple[ToolSpec, ...]) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if not tools and choice != "none":
        raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
    if choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict):
        if fn.get("name") not in {t.name for t in tools}:
            raise InvalidRequest(f"tool_choice names {fn.get('name')!r}, which is not in 'tools'",
                                 param="tool_choice")
        return fn["name"]
    raise InvalidRequest("'tool_choice' must be auto, none, required or "
                         "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def _message_tool_calls(m: dict, i: int) -> tuple[ToolCall, ...]:
    calls = m.get("tool_calls")
    if calls is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if m.get("role") != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(f"{where}: only assistant messages carry a list of tool calls", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(c.get("id", ""), str) or c.get("type", "function") != "function":
            raise InvalidRequest(f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                                 "'arguments'}}}}", param=f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidRequest(f"{where}[{j}].function.arguments must be a JSON object (as a string)",
                                 param=f"{where}[{j}].function.arguments")
        cid = c.get("id") if isinstance(c.get("id"), str) else f"call_{i}_{j}"
        out.append(ToolCall(cid, fn["name"], json.dumps(parsed, ensure_ascii=False)))
    return tuple(out)


def _content(msg: dict, i: int) -> str | None:
    c = msg.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                     param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                         param=f"messages[{i}].content")


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                                 param=f"messages[{i}].role")
        calls = _message_tool_calls(m, i)
        call_id = m.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise InvalidRequest(f"messages[{i}]: a tool message needs 'tool_call_id'",
                                 param=f"messages[{i}].tool_call_id")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(f"messages[{i}].name must be a string", param=f"messages[{i}].name")
        out.append(ChatMessage("system" if role == "developer" else role, _content(m, i), name, calls,
                               call_id if role == "tool" else None))
    return tuple(out)


def parse_chat(body: dict, request_id: str, served: set[str], n_ctx: int) -> ParsedRequest:
    model = check_model(body, served)
    _refuse_unsupported(body)
    stream, include_usage = _stream_flags(body)
    messages = _messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if top and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params = dataclasses.replace(sampling_params(body, n_ctx, None), logprobs=logprobs, top_logprobs=top)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    constraint = response_format(body)
    if constraint is not None and choice not in ("auto", "none"):
        raise InvalidRequest("'response_format' and a forced 'tool_choice' cannot both constrain the output",
                             param="tool_choice")
    req = Request(id=request_id, params=params, messages=messages,
                  template_kwargs=tuple(sorted(kwargs.items())), constraint=constraint, tools=tools,
                  tool_choice=choice, parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
                  cache_prompt=_bool(body, "cache_prompt", True), cache_pin=_bool(body, "cache_pin", False),
                  speculate=_speculate(body))
    return ParsedRequest(req, stream, include_usage, model)


def parse_completion(body: dict, request_id: str, served: set[str], n_ctx: int) -> ParsedRequest:
    model = check_model(body, served)
    _refuse_unsupported(body)
    stream, include_usage = _stream_flags(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif prompt and _is_ids(prompt):
        text, ids = None, tuple(prompt)
    elif prompt is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    else:
        raise InvalidRequest("'prompt' must be a string or a non-empty list of token ids "
                             "(batches of several prompts are not supported)", param="prompt")
    top = _int(body, "logprobs", 0, 5, None)  # the legacy API: an int, how many alternatives
    params = dataclasses.replace(sampling_params(body, n_ctx, 16), logprobs=top is not None, top_logprobs=top or 0)
    req = Request(id=request_id, params=params, prompt=text, prompt_ids=ids, constraint=response_format(body),
                  cache_prompt=_bool(body, "cache_prompt", True), cache_pin=_bool(body, "cache_pin", False),
                  speculate=_speculate(body))
    return ParsedRequest(req, stream, include_usage, model)


def _speculate(body: dict) -> str | None:
    """Our extension: "off", "lookup" or "draft" for this request (absent or null: the server's default)."""
    v = body.get("speculate")
    if v is not None and v not in SPECULATE_MODES:
        raise InvalidRequest(f"'speculate' must be one of {', '.join(SPECULATE_MODES)}; got {v!r}",
                             param="speculate")
    return v


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_tokenize(body: dict) -> tuple[str, bool, bool, bool]:
    """llama-server's /tokenize body: (content, add_special, parse_special, with_pieces)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidRequest("'content' is required and must be a string", param="content")
    return (content, _bool(body, "add_special", False), _bool(body, "parse_special", True),
            _bool(body, "with_pieces", False))


def parse_detokenize(body: dict) -> tuple[int, ...]:
    """llama-server's /detokenize body: the token ids (checked against the vocabulary by the engine)."""
    tokens = body.get("tokens")
    if not _is_ids(tokens):
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


# -- responses ----------------------------------------------------------------------------------

def usage_dict(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                                          for t in e.top]} for e in entries],
            "refusal": None}


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def chat_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    calls = [c for d in deltas for c in d.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.text for d in deltas)}
    reasoning = "".join(d.reasoning for d in deltas)
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = tool_call_dicts(calls)
    return {
        "id": p.request.id, "object": "chat.completion", "created": int(time.time()), "model": p.model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "message": message,
                     "logprobs": _chat_logprobs(lps) if p.request.params.logprobs else None,
                     "finish_reason": done.finish_reason}],
        "usage": usage_dict(done), "timings": done.timings.as_dict(),
    }


def completion_response(p: ParsedRequest, deltas: list[Delta], done: Done, fingerprint: str) -> dict[str, Any]:
    lps = [e for d in deltas for e in d.logprobs]
    return {
        "id": p.request.id, "object": "text_completion", "created": int(time.time()), "model": p.model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": "".join(d.text for d in deltas),
                     "logprobs": _completion_logprobs(lps, 0) if p.request.params.logprobs else None,
                     "finish_reason": done.finish_reason}],
        "usage": usage_dict(done), "timings": done.timings.as_dict(),
    }


class ChunkWriter:
    """Builds the SSE chunks of one streamed response, chat or completion."""

    def __init__(self, p: ParsedRequest, chat: bool, fingerprint: str) -> None:
        self.p, self.chat = p, chat
        self.base = {"id": p.request.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": p.model, "system_fingerprint": fingerprint}
        self._delta_parts: tuple[bytes, bytes] | None = None
        self._offset = 0  # text_offset of the legacy completions logprobs
        self._n_calls = 0

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body = {**self.base, "choices": [choice] if choice is not None else [], **extra}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self) -> bytes | None:
        return self._chunk(self._choice("", None, role=True)) if self.chat else None

    def delta(self, ev: Delta) -> bytes:
        out = b""
        if ev.reasoning and self.chat:
            out += self._chunk({"index": 0, "delta": {"reasoning_content": ev.reasoning}, "logprobs": None,
                                "finish_reason": None})
            if not (ev.text or ev.tool_calls or ev.logprobs):
                return out
        if ev.tool_calls and self.chat:
            for c in ev.tool_calls:  # OpenAI's shape: id, type and name first, then the arguments
                i = self._n_calls
                self._n_calls += 1
                head = {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
                out += self._chunk({"index": 0, "delta": {"tool_calls": [head]}, "logprobs": None,
                                    "finish_reason": None})
                out += self._chunk({"index": 0, "delta": {"tool_calls": [
                    {"index": i, "function": {"arguments": c.arguments}}]}, "logprobs": None, "finish_reason": None})
            if not ev.text:
                return out
        if ev.logprobs:
            choice = self._choice(ev.text, None)
            if self.chat:
                choice["logprobs"] = _chat_logprobs(list(ev.logprobs))
            else:
                choice["logprobs"] = _completion_logprobs(list(ev.logprobs), self._offset)
            self._offset += sum(len(e.token) for e in ev.logprobs)
            return out + self._chunk(choice)
        return out + self._text_chunk(ev.text)

    def _text_chunk(self, text: str) -> bytes:
        # the hot path (one call per token): the chunk around the text is encoded once
        if self._delta_parts is None:
            marker = "\x00TEXT\x00"
            whole = self._chunk(self._choice(marker, None)).decode()
            at = whole.index(json.dumps(marker)[1:-1]) - 1
            self._delta_parts = (whole[:at].encode(), whole[at + len(json.dumps(marker)):].encode())
        head, tail = self._delta_parts
        return head + json.dumps(text).encode() + tail

    def last(self, done: Done) -> bytes:
        out = self._chunk(self._choice(None if self.chat else "", done.finish_reason),
                          timings=done.timings.as_dict())
        if self.p.include_usage:
            out += self._chunk(None, usage=usage_dict(done))
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"
