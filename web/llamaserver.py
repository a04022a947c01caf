"""llama-server's own HTTP surface, for the tools written against it (editor plugins such as
llama.vim and llama.vscode, scripts, its web UI's probes): `POST /completion` (and
`/completions`, which llama-server also answers natively), `POST /infill`, `GET /props`,
`POST /apply-template`, and the OpenAI routes without their `/v1` (`/chat/completions`,
`/models`). Its `/embeddings` and `/embedding` are web/embeddings.py's, beside OpenAI's.

/completion and /infill are translated onto the OpenAI completions request
(`serving.parse_submit`): validation, limits, the prompt cache, speculation and timings are those of
/v1/completions. What that request cannot say (n_predict -1 or 0, up to 20 n_probs, a GBNF
grammar) is set on the validated request (`Native.adjust`). Absent sampling fields take
llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), not OpenAI's.
Sampler options this engine does not have (UNSUPPORTED) are refused by name unless neutral;
options that tune llama-server's own scheduling (id_slot, n_keep, n_indent,
t_max_predict_ms, ...) are accepted and have no effect. Replies and streams have
llama-server's shape: `content`, `stop`, `stop_type`, `timings`, `completion_probabilities`,
`response_fields` picking what is answered; a stream is `data:` lines, the last with
`stop: true`, and no `[DONE]`. Several prompts (prompts.py's rule) are a batch: an array of
results, each with its `index`, and a stream whose chunks carry their prompt's.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flask import Blueprint, jsonify, request

from appliance import __version__
from appliance.engine.chat import CHATML
from appliance.engine.process import EngineClient
from appliance.engine.types import (Constraint, Delta, Done, Progress, Request, SamplingParams, Timings, TokenLogprob,
                                    TopLogprob)
from appliance.errors import ApplianceError

from . import api, openai_chat, openai_responses, prompts, responses, serving
from .http_errors import error_response
from .batch import Merged
from .infill import infill_ids
from .serving import need
from .params import MAX_TOP_LOGPROBS, N_CTX, SAMPLERS, Param
from .sampling import LogitBias

Tokenize = Callable[[list[str]], list[list[int]]]
Prompt = str | dict[str, Any] | list[Any]    # text, a multimodal prompt, or token ids (mixed with strings, as read)

bp = Blueprint("llamaserver", __name__)


@bp.errorhandler(ApplianceError)
def _llama_error(e: ApplianceError):
    """OpenAI's error body with llama-server's type where it has its own (a prompt over the
    context: exceed_context_size_error, which its clients match); OpenAI's routes keep theirs."""
    return error_response(e, llama=True)

DEFAULTS = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)  # llama-server's, for /completion
RANDOM_SEED = 0xFFFFFFFF     # llama-server's LLAMA_DEFAULT_SEED: a new random seed per request
PASSED = ("temperature", "top_k", "top_p", "min_p", "stop", "repeat_penalty", "repeat_last_n", "presence_penalty",
          "frequency_penalty", "ignore_eos", "cache_prompt", "cache_pin", "speculate", "stream", "keep_alive",
          "return_progress", "timings_per_token", "lora",
          "samplers", "dry_sequence_breakers", *(p.name for p in SAMPLERS))
# llama-server's options that change the output and that this engine does not have: (neutral, what)
UNSUPPORTED = {"n_cmpl": (1, "several completions")}

N_PREDICT = Param("n_predict", "integer", "Most tokens to generate; -1 until the end of the context or of "
                  "generation, 0 only evaluates the prompt into the cache", lo=-1, hi=N_CTX, default=-1)
N_PROBS = Param("n_probs", "integer", "Report the N most likely tokens at each generated token",
                lo=0, hi=MAX_TOP_LOGPROBS, default=0)
RETURN_TOKENS = Param("return_tokens", "boolean", "Answer the generated token ids in `tokens`", default=False)
POST_SAMPLING = Param("post_sampling_probs", "boolean", "n_probs as the probabilities the token was drawn with, after "
                      "the sampler chain (`prob`, `top_probs`), not the model's", default=False)

# -- request: llama-server -> OpenAI ------------------------------------------------------------
@dataclass(frozen=True)
class Native:
    """What a llama-server body asks beyond the OpenAI request it is translated to."""

    n_predict: int = -1
    n_probs: int = 0
    return_tokens: bool = False
    grammar: str | None = None
    fields: tuple[str, ...] = ()      # response_fields: answer only these
    logit_bias: LogitBias = ()
    post_sampling: bool = False       # post_sampling_probs

    @staticmethod
    def read(body: dict[str, Any], n_ctx: int, tokenize: Tokenize | None = None) -> Native:
        """`tokenize`: texts -> their token ids (no special tokens), for a logit_bias naming text."""
        grammar, fields = body.get("grammar") or None, body.get("response_fields")
        fields = [] if fields is None else fields
        need(grammar is None or isinstance(grammar, str), "'grammar' must be a GBNF grammar (a string)", "grammar")
        need(grammar is None or body.get("json_schema") is None, "give 'grammar' or 'json_schema', not both", "grammar")
        need(isinstance(fields, list) and all(isinstance(f, str) for f in fields),
             "'response_fields' must be a list of field names", "response_fields")
        return Native(N_PREDICT.read(body, n_ctx), N_PROBS.read(body), RETURN_TOKENS.read(body), grammar, tuple(fields),
                      logit_bias(body.get("logit_bias"), tokenize), POST_SAMPLING.read(body))

    def adjust(self, req: Request) -> Request:
        """The validated /v1/completions request, with what its body could not say."""
        params = dataclasses.replace(req.params, max_tokens=None if self.n_predict < 0 else max(self.n_predict, 1),
                                     logprobs=self.n_probs > 0, top_logprobs=self.n_probs, logit_bias=self.logit_bias,
                                     post_sampling_probs=self.post_sampling)
        constraint = Constraint("gbnf", self.grammar) if self.grammar else req.constraint
        return dataclasses.replace(req, params=params, constraint=constraint)


def logit_bias(value: Any, tokenize: Tokenize | None) -> LogitBias:
    """llama-server's logit_bias: [[token id or text, bias], ...] or {"token id or text": bias}. A
    bias is a number (any size) or false, which bans the token; a text's every token (tokenized
    without special tokens, as llama-server does) gets the bias."""
    if value is None:
        return ()
    need(isinstance(value, (list, dict)), "'logit_bias' must be [[token id or text, bias], ...] or "
         "{\"token id or text\": bias}", "logit_bias")
    pairs = list(value.items()) if isinstance(value, dict) else value
    out: list[tuple[int | str, float]] = []
    for pair in pairs:
        need(isinstance(pair, (list, tuple)) and len(pair) == 2, f"logit_bias entries must be [token id or "
             f"text, bias] pairs; got {pair!r}", "logit_bias")
        key, bias = pair
        need(bias is False or (isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)),
             f"a logit_bias bias must be a number, or false to ban the token; got {bias!r}", "logit_bias")
        ok = isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and key >= 0)
        need(ok, f"a logit_bias token must be a token id or a text; got {key!r}", "logit_bias")
        if isinstance(value, dict) and key.isascii() and key.isdigit():
            key = int(key)   # the object's keys are strings: a number there is a token id
        out.append((key, float("-inf") if bias is False else float(bias)))
    texts = list(dict.fromkeys(k for k, _ in out if isinstance(k, str)))
    need(not texts or tokenize is not None, "a logit_bias naming text needs the model's tokenizer", "logit_bias")
    ids = dict(zip(texts, tokenize(texts))) if texts else {}
    return tuple((t, b) for k, b in out for t in ((k,) if isinstance(k, int) else ids[k]))


def openai_body(body: dict[str, Any], prompt: Prompt | list[Prompt]) -> dict[str, Any]:
    """The /v1/completions body that serves a /completion body (its prompt given: text, ids or a
    multimodal prompt, or a list of them, a batch)."""
    for name, (neutral, what) in UNSUPPORTED.items():
        value = body.get(name)
        need(value in (None, neutral, [], {}), f"'{name}' ({what}) is not supported by this server", name)
    oai: dict[str, Any] = {name: body[name] for name in PASSED if body.get(name) is not None}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        oai.setdefault(name, getattr(DEFAULTS, name))
    if isinstance(oai["temperature"], (int, float)) and oai["temperature"] < 0:
        oai["temperature"] = 0.0             # llama-server: greedy
    if body.get("seed") not in (None, -1, RANDOM_SEED):
        oai["seed"] = body["seed"]
    schema = body.get("json_schema")
    if schema is not None:
        need(isinstance(schema, dict), "'json_schema' must be a JSON schema object", "json_schema")
        oai["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return {"model": body["model"], "prompt": prompt, **oai}


def read_prompts(value: Any) -> list[Prompt]:
    """llama-server's prompts: one, or several in a list (prompts.split: its rule), each a string,
    token ids, ids and strings mixed, or a multimodal prompt ({"prompt_string",
    "multimodal_data"}: prompts.py reads it)."""
    need(value is not None, "'prompt' is required", "prompt")
    parts = prompts.split(value)
    for i, p in enumerate(parts):
        pieces = isinstance(p, (str, dict)) or (isinstance(p, list) and p and all(
            isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in p))
        where = "prompt" if len(parts) == 1 else f"prompt[{i}]"
        need(bool(pieces), f"'{where}' must be a string, a list of token ids, or token ids and strings mixed", where)
    return parts


def token_ids(engine: EngineClient, pieces: Sequence[int | str]) -> list[int]:
    """A mixed prompt as ids: its strings tokenized as llama-server does (special tokens read; the
    model's BOS only before a first piece that is a string)."""
    texts = [(p, i == 0, True) for i, p in enumerate(pieces) if isinstance(p, str)]
    tokenized = iter(engine.tokenize_many(texts))
    return [t for p in pieces for t in (next(tokenized) if isinstance(p, str) else (p,))]


# -- response: engine events -> llama-server ------------------------------------------------------
def settings(p: SamplingParams, native: Native, stream: bool) -> dict[str, Any]:
    """llama-server's generation_settings (and /props' default ones)."""
    return {"n_predict": native.n_predict, "seed": RANDOM_SEED if p.seed is None else p.seed,
            "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repeat_last_n": p.penalty_last_n, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "stop": list(p.stop), "max_tokens": native.n_predict, "ignore_eos": p.ignore_eos, "stream": stream,
            "n_probs": native.n_probs, "grammar": native.grammar or "", "samplers": list(p.samplers),
            "dry_sequence_breakers": list(p.dry_sequence_breakers), **{q.name: getattr(p, q.name) for q in SAMPLERS}}


def timings(done: Done | Timings) -> dict[str, Any]:
    """llama-server's timings object, of a request's end or (timings_per_token) of one token."""
    t = done.timings if isinstance(done, Done) else done
    per = lambda ms, n: round(ms / n, 3) if n else 0.0  # noqa: E731
    return {**t.as_dict(), "prompt_per_token_ms": per(t.prompt_ms, t.prompt_n),
            "predicted_per_token_ms": per(t.predicted_ms, t.predicted_n)}


def stop_type(done: Done) -> tuple[str, str]:
    """llama-server's stop_type and stopping_word."""
    if done.finish_reason == "length":
        return "limit", ""
    if done.stop_string is not None:
        return "word", done.stop_string
    return ("none" if done.finish_reason == "cancelled" else "eos"), ""


def _prob(e: TokenLogprob | TopLogprob, post: bool) -> dict[str, Any]:
    head = {"id": e.id, "token": e.token, "bytes": list(e.bytes)}
    return {**head, "prob": math.exp(e.logprob)} if post else {**head, "logprob": e.logprob}


def probabilities(entries: Sequence[TokenLogprob], post: bool = False) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities; `post` (post_sampling_probs): the probabilities
    after the sampler chain, as `prob` and `top_probs`."""
    return [{**_prob(e, post), "top_probs" if post else "top_logprobs": [_prob(t, post) for t in e.top]}
            for e in entries]


def pick(out: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """llama-server's response_fields: only these; a nested one ("timings/prompt_n") keyed by its path."""
    if not fields:
        return out
    got = {}
    for path in fields:
        value: Any = out
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            got[path] = value
    return got


@dataclass(frozen=True)
class Reply:
    """One submitted /completion or /infill request, answered in llama-server's shape: a result
    per prompt (an array of them for several prompts, as llama-server answers)."""

    sub: serving.Submitted
    native: Native
    prompts: tuple[str, ...]      # each prompt as text (llama-server's `prompt`)

    @property
    def generated(self) -> bool:
        """Whether the reply is answered: n_predict 0 asks for the prompt's evaluation only (the
        one token the engine then runs is not the client's)."""
        return self.native.n_predict != 0

    def final(self, deltas: list[Delta], done: Done) -> dict[str, Any] | list[dict[str, Any]]:
        """The whole reply: one prompt's result, or the array of a batch's."""
        got = self.results(deltas, done)
        return got[0] if len(got) == 1 else got

    def results(self, deltas: list[Delta], done: Done, stream: bool = False) -> list[dict[str, Any]]:
        """Each prompt's last object: its whole result, or (a stream's) the figures after its chunks."""
        each = self.sub.stream.parts if isinstance(self.sub.stream, Merged) else [done]
        return [self._result(i, [d for d in deltas if d.index == i], part, stream) for i, part in enumerate(each)]

    def evaluated(self, i: int) -> int:
        """Prompt `i`'s tokens."""
        stream = self.sub.stream
        return (stream.accepted[i] if isinstance(stream, Merged) else self.sub.accepted).n_prompt_tokens

    def _result(self, i: int, deltas: list[Delta], done: Done, stream: bool) -> dict[str, Any]:
        kept = deltas if self.generated else []
        content = "".join(d.text for d in kept)
        tokens = done.token_ids if self.generated and self.native.return_tokens and not stream else ()
        kind, word = stop_type(done)
        out = {"index": i, "content": content, "tokens": list(tokens), "id_slot": -1, "stop": True,
               "model": self.sub.parsed.model,
               "tokens_predicted": done.usage.completion_tokens if self.generated else 0,
               "tokens_evaluated": done.usage.prompt_tokens,
               "generation_settings": settings(self.sub.parsed.request.params, self.native, stream),
               "prompt": self.prompts[i], "truncated": False, "stop_type": kind, "stopping_word": word,
               "tokens_cached": done.usage.cached_tokens, "timings": timings(done)}
        if self.native.n_probs and not stream:
            out["completion_probabilities"] = probabilities([e for d in kept for e in d.logprobs],
                                                            self.native.post_sampling)
        return pick(out, self.native.fields)


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class CompletionWriter:
    """llama-server's /completion stream: each token's text (and ids) as it comes, then the last
    object with `stop: true`; no `[DONE]` (that is the OpenAI routes')."""

    error = staticmethod(responses.ChunkWriter.error)
    idle = staticmethod(responses.ChunkWriter.idle)

    def __init__(self, reply: Reply) -> None:
        self.reply, self.n = reply, Counter[int]()    # each prompt's tokens so far

    def start(self) -> bytes:
        return b""

    def progress(self, ev: Progress) -> bytes:
        """llama-server's progress object (without the token id 0 its own carries)."""
        return _data({"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0,
                      "tokens_evaluated": ev.total, "prompt_progress": responses.progress_dict(ev)})

    def delta(self, ev: Delta) -> bytes:
        if not self.reply.generated:
            return b""
        self.n[ev.index] += len(ev.token_ids)
        chunk = {"index": ev.index, "content": ev.text, "tokens": list(ev.token_ids), "stop": False, "id_slot": -1,
                 "tokens_predicted": self.n[ev.index], "tokens_evaluated": self.reply.evaluated(ev.index)}
        if ev.logprobs:
            chunk["completion_probabilities"] = probabilities(ev.logprobs, self.reply.native.post_sampling)
        if ev.timings is not None:
            chunk["timings"] = timings(ev.timings)
        return _data(chunk)

    def end(self, done: Done) -> bytes:
        return b"".join(_data(r) for r in self.reply.results([], done, stream=True))


# -- routes ---------------------------------------------------------------------------------------
def _model_name(body: dict[str, Any]) -> str:
    """The default model when the body names none; with one model served, any name is it."""
    return serving.pool().default if body.get("model") is None else serving.resolve_model(body)


def _complete(prompts_of: Callable[[EngineClient, dict[str, Any], Native], list[Prompt]]) -> Any:
    """Serve a /completion or /infill body, its prompts made by `prompts_of` (text, ids or a
    multimodal prompt each; several are a batch: web/batch.py)."""
    body = serving.read_body()
    body = {**body, "model": _model_name(body)}
    with serving.model(body) as (_, engine):
        native = Native.read(body, serving.n_ctx(engine), lambda texts: engine.tokenize_many(
            [(t, False, False) for t in texts]))
        made = prompts_of(engine, body, native)
        oai = openai_body(body, made[0] if len(made) == 1 else made)
    sub = serving.parse_submit(oai, chat=False, adjust=native.adjust)
    try:
        shown = tuple(p if isinstance(p, str) else str(p.get("prompt_string")) if isinstance(p, dict)
                      else engine.detokenize(tuple(p)).text for p in made)
    except ApplianceError:
        sub.stream.abort()
        raise
    reply = Reply(sub, native, shown)
    return serving.reply(sub, lambda: CompletionWriter(reply), reply.final)


def _completion_prompts(engine: EngineClient, body: dict[str, Any], native: Native) -> list[Prompt]:
    return [p if isinstance(p, (str, dict)) else token_ids(engine, p) for p in read_prompts(body.get("prompt"))]


@bp.post("/completion")
@bp.post("/completions")    # llama-server's too (its OpenAI one is /v1/completions only)
def completion():
    return _complete(_completion_prompts)


@bp.post("/infill")
def infill():
    return _complete(lambda engine, body, native: [infill_ids(engine, body, native.n_predict)])


@bp.get("/props")
def props():
    name = _model_name({"model": request.args.get("model")})
    with serving.model({"model": name}) as (_, engine):
        info = engine.info
    return jsonify({
        "default_generation_settings": {"n_ctx": info.n_ctx, "params": settings(DEFAULTS, Native(), False)},
        "total_slots": info.n_slots, "model_alias": name, "model_path": info.model_path,
        "modalities": {"vision": "mmproj" in info.settings, "audio": False, "video": False},
        "endpoint_slots": serving.state().config.server.slots, "endpoint_props": False, "endpoint_metrics": True,
        "webui": True,
        "chat_template": info.chat_template or CHATML, "bos_token": info.bos_text, "eos_token": info.eos_text,
        "build_info": f"appliance-{__version__} ({info.backend})", "is_sleeping": False})


@bp.post("/apply-template")
def apply_template():
    """The chat request's prompt as the model's template renders it; nothing is generated."""
    body = serving.read_body()
    return jsonify({"prompt": serving.render_prompt({**body, "model": _model_name(body)}).text})


# the OpenAI routes without /v1, as llama-server answers them (its own /embeddings: web/embeddings.py)
bp.add_url_rule("/chat/completions", "chat_completions", openai_chat.chat_completions, methods=["POST"])
bp.add_url_rule("/responses", "responses", openai_responses.create, methods=["POST"])
bp.add_url_rule("/models", "models", api.models, methods=["GET"])
