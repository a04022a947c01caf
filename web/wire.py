"""The OpenAI wire format -> engine types. Validation lives here, once, for both endpoints; the
responses are shaped in `responses.py`.

Every client mistake becomes an `InvalidRequest` naming the offending parameter, so the API
answers a 400 (never a 500, which SDKs retry) and nothing reaches the engine. The scalar
parameters are read through their declarations in `params.py` (which `openapi.py` publishes);
the structured ones (messages, tools, response_format, ...) are checked here, a completions
prompt (one, or several: a batch) in prompts.py. Parameters this
version does not implement (NOT_YET: the deprecated functions/function_call, best_of, echo,
suffix) are refused by name rather than silently
ignored; the sampling knobs (with stop, logit_bias and n) are read by `sampling.py`; a few that change nothing for one local model
(IGNORED) are accepted and ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from appliance import jsondepth
from appliance.engine.types import ChatMessage, Constraint, Request, ToolCall, ToolSpec
from appliance.errors import InvalidRequest, ModelNotFound

from . import prompts
from .images import Images
from .lora import lora_of
from .params import CHAT, COMPLETION, RESPONSE_FORMATS, ROLES, STREAM_OPTIONS, TOOL_CHOICES, TOOL_NAME_PATTERN, Param
from .reasoning import reasoning_format, reasoning_kwargs
from .sampling import sampling_params

# accepted and ignored: they change nothing for a single local model
IGNORED = {"user", "store", "metadata", "service_tier",
           "prediction", "modalities", "audio", "n_probs", "id_slot"}
NOT_YET = {"functions": "the deprecated 'functions' (use 'tools')", "function_call": "the deprecated 'function_call'",
           "best_of": "best_of", "echo": "echo", "suffix": "suffix"}
# arrays and objects inside each other (jsondepth says why this many)
MAX_JSON_DEPTH = jsondepth.MAX_DEPTH


@dataclass(frozen=True)
class ParsedRequest:
    request: Request
    stream: bool
    include_usage: bool
    model: str
    # a completions request of several prompts: a request each (`request` is the first's, under
    # the batch's id: what the replies' writers read); () for one prompt
    batch: tuple[Request, ...] = ()


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body's JSON object, whatever its Content-Type: Ollama's documented `curl -d` sends a
    form type and litellm's ollama_chat none, as Ollama reads them. A page of another site
    posting a form is refused by its Origin instead (web/origins.py)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = load_json(text, "the JSON body")
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {type(body).__name__}")
    try:  # JSON's \ud800-style escapes can smuggle lone surrogates, which are not text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the body contains an unpaired UTF-16 surrogate escape (not valid Unicode)") from None
    return body


def load_json(text: str, what: str, param: str | None = None) -> Any:
    """`json.loads` for JSON a client wrote; invalid JSON stays a JSONDecodeError for the caller
    to word. What Python's parser would take but nothing after it should meet is an
    InvalidRequest naming `what`: NaN, Infinity and numbers past a float's range (a reply
    echoing them would not be JSON), an integer past Python's digit limit (int() refuses it), and
    nesting past MAX_JSON_DEPTH (the parser's RecursionError, or the walk after it)."""
    try:
        return jsondepth.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # too deep, a hook's refusal, or int() refusing a literal past its digit limit
        reason = e if isinstance(e, (_Refused, jsondepth.TooDeep)) else \
            f"has an integer of more than {sys.get_int_max_str_digits()} digits"
        raise InvalidRequest(f"{what} {reason}", param=param) from None


class _Refused(ValueError):
    """A number `load_json` refuses (its message follows the document's name)."""


def _no_constant(name: str) -> float:
    raise _Refused(f"has {name}, which is not a JSON number")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"has {literal}, a number past the largest float")
    return value


# -- structured parameters ----------------------------------------------------------------------

def _refuse_unsupported(body: dict) -> None:
    for key, what in NOT_YET.items():
        v = body.get(key)
        if v in (None, False, [], {}):
            continue
        raise InvalidRequest(f"'{key}' ({what}) is not supported by this server version", param=key)


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


def _stream_flags(body: dict, table: dict[str, Param]) -> tuple[bool, bool]:
    stream = table["stream"].read(body)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return stream, STREAM_OPTIONS["include_usage"].read(opts)


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
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(f"response_format type must be {', '.join(RESPONSE_FORMATS[:-1])} or "
                             f"{RESPONSE_FORMATS[-1]}; got {kind!r}", param="response_format.type")
    if js is None:
        raise InvalidRequest("response_format.json_schema (with a 'schema') is required for type json_schema",
                             param="response_format.json_schema")
    return Constraint("json_schema", json.dumps(js.get("schema", {}), sort_keys=True))


def constraint_of(body: dict) -> Constraint | None:
    """What the output must match: OpenAI's response_format, or llama-server's top-level `grammar`
    (GBNF, read by llguidance as on /completion) or `json_schema`; one of them."""
    rf, grammar, schema = response_format(body), body.get("grammar"), body.get("json_schema")
    given = [k for k, v in (("response_format", rf), ("grammar", grammar), ("json_schema", schema)) if v]
    if len(given) > 1:
        raise InvalidRequest(f"give one of {' or '.join(given)}: each constrains the whole output", param=given[1])
    if grammar:
        if not isinstance(grammar, str):
            raise InvalidRequest("'grammar' must be a GBNF grammar (a string)", param="grammar")
        return Constraint("gbnf", grammar)
    if schema:
        if not isinstance(schema, dict):
            raise InvalidRequest("'json_schema' must be a JSON schema object", param="json_schema")
        return Constraint("json_schema", json.dumps(schema, sort_keys=True))
    return rf


TOOL_NAME = re.compile(TOOL_NAME_PATTERN)


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
        out.append(ToolSpec(name, desc, json.dumps(params)))   # in the client's key order, as llama-server keeps it
    return tuple(out)


def _tool_choice(body: dict, tools: tuple[ToolSpec, ...]) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if not tools and choice != "none":
        raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
    if choice in TOOL_CHOICES:
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict):
        if fn.get("name") not in {t.name for t in tools}:
            raise InvalidRequest(f"tool_choice names {fn.get('name')!r}, which is not in 'tools'",
                                 param="tool_choice")
        return fn["name"]
    raise InvalidRequest(f"'tool_choice' must be {', '.join(TOOL_CHOICES)} or "
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
        args, at = fn.get("arguments", "{}"), f"{where}[{j}].function.arguments"
        try:
            parsed = load_json(args, at, param=at) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidRequest(f"{at} must be a JSON object (as a string)", param=at)
        cid = c.get("id") if isinstance(c.get("id"), str) else f"call_{i}_{j}"
        out.append(ToolCall(cid, fn["name"], json.dumps(parsed, ensure_ascii=False)))
    return tuple(out)


def _content(msg: dict, i: int, images: Images) -> str | None:
    """The message's text; each image part becomes the image marker there (web/images.py)."""
    c = msg.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if isinstance(part, dict) and part.get("type") == "image_url":
                parts.append(images.part(part, f"messages[{i}].content[{j}]"))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text and image_url parts are supported",
                                     param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text and image_url parts",
                         param=f"messages[{i}].content")


def _messages(body: dict, images: Images) -> tuple[ChatMessage, ...]:
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
        thought = m.get("reasoning_content")
        if thought is not None and not isinstance(thought, str):
            raise InvalidRequest(f"messages[{i}].reasoning_content must be a string",
                                 param=f"messages[{i}].reasoning_content")
        out.append(ChatMessage("system" if role == "developer" else role, _content(m, i, images), name, calls,
                               call_id if role == "tool" else None, thought if role == "assistant" else None))
    return tuple(out)


def _continuation(body: dict, messages: tuple[ChatMessage, ...]) -> bool:
    """Whether the final message is continued (an assistant prefill) rather than answered."""
    cont, gen = CHAT["continue_final_message"].read(body), CHAT["add_generation_prompt"].read(body)
    last_is_assistant = messages[-1].role == "assistant"
    if cont is None:
        cont = last_is_assistant and gen is not True
    if cont and gen:
        raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                             param="continue_final_message")
    if cont and not last_is_assistant:
        raise InvalidRequest("'continue_final_message' needs the last message to be the assistant's",
                             param="continue_final_message")
    if cont and messages[-1].tool_calls:
        raise InvalidRequest("a final message with tool calls cannot be continued", param="continue_final_message")
    return cont


def parse_chat(body: dict, request_id: str, served: set[str], n_ctx: int) -> ParsedRequest:
    t = CHAT
    model = check_model(body, served)
    _refuse_unsupported(body)
    stream, include_usage = _stream_flags(body, t)
    images = Images()
    messages = _messages(body, images)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    kwargs = {**reasoning_kwargs(body.get("reasoning_effort"), "reasoning_effort"), **kwargs}
    logprobs = t["logprobs"].read(body)
    top = t["top_logprobs"].read(body)
    if top and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params = dataclasses.replace(sampling_params(body, n_ctx, t), logprobs=logprobs, top_logprobs=top)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    constraint = constraint_of(body)
    if constraint is not None and choice not in ("auto", "none"):
        raise InvalidRequest("'response_format' and a forced 'tool_choice' cannot both constrain the output",
                             param="tool_choice")
    cont = _continuation(body, messages)
    req = Request(id=request_id, params=params, messages=messages, add_generation_prompt=not cont,
                  continue_final=cont,
                  template_kwargs=tuple(sorted(kwargs.items())), constraint=constraint, tools=tools,
                  tool_choice=choice, parallel_tool_calls=t["parallel_tool_calls"].read(body),
                  cache_prompt=t["cache_prompt"].read(body), cache_pin=t["cache_pin"].read(body),
                  return_progress=t["return_progress"].read(body), timings_per_token=t["timings_per_token"].read(body),
                  lora=lora_of(body.get("lora")),
                  speculate=t["speculate"].read(body), n=t["n"].read(body), images=tuple(images.found),
                  reasoning_format=reasoning_format(body))
    return ParsedRequest(req, stream, include_usage, model)


def parse_completion(body: dict, request_id: str, served: set[str], n_ctx: int) -> ParsedRequest:
    """A completions body; several prompts (prompts.py) are a batch, a request per prompt."""
    t = COMPLETION
    model = check_model(body, served)
    _refuse_unsupported(body)
    stream, include_usage = _stream_flags(body, t)
    batch = prompts.read_all(body.get("prompt"))
    top = t["logprobs"].read(body)  # the legacy API: an int, how many alternatives
    params = dataclasses.replace(sampling_params(body, n_ctx, t), logprobs=top is not None, top_logprobs=top or 0)
    req = Request(id=request_id, params=params, prompt=batch[0].text, prompt_ids=batch[0].ids,
                  constraint=constraint_of(body), cache_prompt=t["cache_prompt"].read(body),
                  cache_pin=t["cache_pin"].read(body), speculate=t["speculate"].read(body), n=t["n"].read(body),
                  images=batch[0].images, return_progress=t["return_progress"].read(body),
                  timings_per_token=t["timings_per_token"].read(body), lora=lora_of(body.get("lora")))
    several = tuple(dataclasses.replace(req, id=f"{request_id}-{i}", prompt=p.text, prompt_ids=p.ids, images=p.images)
                    for i, p in enumerate(batch)) if len(batch) > 1 else ()
    return ParsedRequest(req, stream, include_usage, model, several)
