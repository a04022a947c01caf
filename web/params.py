"""The scalar request parameters of the HTTP API, each declared once.

A `Param` says a parameter's JSON type, its range or choices, its default and a line of help.
`wire.py` validates a request body against these declarations (`Param.read`, which also owns
the error messages) and `openapi.py` publishes them as the request schemas, so what the
document promises and what the server accepts cannot drift apart.
Parameters with structure (messages, tools, tool_choice, response_format, stop, prompt,
stream_options) keep hand-written validators and schemas; the scalar limits inside them are
the constants below, used by both.

Every declared parameter may be null, and null means its default, as an absent one does.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from appliance.errors import InvalidRequest

# an upper bound that is the context size, known only when a request arrives
N_CTX = "n_ctx"

MAX_STOPS = 16
MAX_LOGIT_BIAS = 2048        # tokens one logit_bias may name (each costs the sampler one add a step)
MAX_CHOICES = 128            # n, as OpenAI bounds it; the engine bounds it by --max-choices and its slots
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
SPECULATE_MODES = ("off", "lookup", "draft", "mtp")
ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("auto", "none", "required")
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

KINDS = ("number", "integer", "boolean", "string")


@dataclass(frozen=True)
class Param:
    """One scalar parameter. `kind` is its JSON schema type; with `enum`, the value must be one
    of those (compared with ==) and `refusal` is the message otherwise."""

    name: str
    kind: str
    help: str
    lo: float | None = None
    hi: float | str | None = None    # None: unbounded; N_CTX: the request's context size
    enum: tuple[Any, ...] = ()
    default: Any = None
    refusal: str = "'{name}' must be one of {choices}; got {value!r}"

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    def bounds(self, n_ctx: int | None) -> tuple[float | None, float | None]:
        if self.hi == N_CTX:
            assert n_ctx is not None, f"{self.name} is bounded by the context size"
            return self.lo, n_ctx
        return self.lo, self.hi

    def read(self, body: dict, n_ctx: int | None = None) -> Any:
        """The value of this parameter in `body`, checked; its default when absent or null."""
        v = body.get(self.name)
        if v is None:
            return self.default
        if self.enum:
            if v not in self.enum:
                choices = ", ".join(str(c) for c in self.enum)
                raise InvalidRequest(self.refusal.format(name=self.name, choices=choices, value=v),
                                     param=self.name)
            return v
        if self.kind == "boolean":
            if not isinstance(v, bool):
                raise self._error("true or false")
            return v
        return self._read_number(v, n_ctx)

    def _read_number(self, v: Any, n_ctx: int | None) -> float | int:
        integer = self.kind == "integer"
        # bool is an int to Python but not a number to JSON; only a float can be inf or nan
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) \
                or (isinstance(v, float) and not math.isfinite(v)):
            raise self._error("an integer" if integer else "a number")
        lo, hi = self.bounds(n_ctx)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise self._error(f"{bound}, got {v}")
        return v if integer else float(v)

    def _error(self, what: str) -> InvalidRequest:
        return InvalidRequest(f"'{self.name}' must be {what}", param=self.name)


def _flag(name: str, default: bool, help: str) -> Param:
    return Param(name, "boolean", help, default=default)


def _table(*params: Param) -> dict[str, Param]:
    table = {p.name: p for p in params}
    assert len(table) == len(params), "a parameter is declared twice"
    return table


MAX_TOKENS = Param("max_tokens", "integer", "Most tokens to generate (default: the server's "
                   "--max-tokens-default, else up to the end of the context)", lo=1, hi=N_CTX)

# the sampling knobs both endpoints take, in the order wire checks them
SAMPLING = (
    Param("max_completion_tokens", "integer", "Most tokens to generate; wins over max_tokens", lo=1, hi=N_CTX),
    MAX_TOKENS,
    Param("temperature", "number", "Softmax temperature; 0 is greedy (the most likely token)",
          lo=0.0, hi=2.0, default=1.0),
    Param("top_p", "number", "Keep the most likely tokens until their probability reaches top_p",
          lo=0.0, hi=1.0, default=1.0),
    Param("top_k", "integer", "Keep only the k most likely tokens; 0 keeps all", lo=0, default=0),
    Param("min_p", "number", "Drop tokens less likely than min_p times the most likely one",
          lo=0.0, hi=1.0, default=0.0),
    Param("presence_penalty", "number", "Subtracted from the logit of each token among the last "
          "repeat_last_n generated",
          lo=-2.0, hi=2.0, default=0.0),
    Param("frequency_penalty", "number", "Subtracted from a token's logit once per use among the last "
          "repeat_last_n generated",
          lo=-2.0, hi=2.0, default=0.0),
    Param("repeat_penalty", "number", "llama.cpp's name for repetition_penalty, used when that is absent",
          lo=0.01, hi=10.0, default=1.0),
    Param("repetition_penalty", "number", "Shrinks the logits of tokens among the last repeat_last_n "
          "generated; 1 disables "
          "(default: repeat_penalty)", lo=0.01, hi=10.0),
    Param("seed", "integer", "Seed of this request's sampling (default: a random one)",
          lo=-(2**63), hi=2**64 - 1),
    _flag("ignore_eos", False, "Keep generating past the end-of-sequence token, up to max_tokens"),
    Param("repeat_last_n", "integer", "How many of the last generated tokens the penalties look at; -1 all, "
          "0 none", lo=-1, hi=N_CTX, default=64),
)

# llama.cpp's other samplers, with llama-server's names, ranges and defaults (engine/output/samplers.py, dry.py)
SAMPLERS = (
    Param("typical_p", "number", "Locally typical sampling: keep the tokens whose surprise is nearest the "
          "entropy until their probability reaches typical_p; 1 disables", lo=0.0, hi=1.0, default=1.0),
    Param("top_n_sigma", "number", "Keep the logits within top_n_sigma standard deviations of the largest; "
          "-1 (or 0) disables", lo=-1.0, default=-1.0),
    Param("xtc_probability", "number", "XTC: how often to exclude the top choices; 0 disables",
          lo=0.0, hi=1.0, default=0.0),
    Param("xtc_threshold", "number", "XTC: the probability from which a choice is a top one (above 0.5: off)",
          lo=0.0, hi=1.0, default=0.1),
    Param("dynatemp_range", "number", "Dynamic temperature: temperature +- this, by the entropy; 0 disables",
          lo=0.0, hi=2.0, default=0.0),
    Param("dynatemp_exponent", "number", "Dynamic temperature: the entropy's exponent", lo=0.0, hi=10.0,
          default=1.0),
    Param("mirostat", "integer", "Mirostat sampling, version 1 or 2, after the temperature; 0 disables",
          enum=(0, 1, 2), default=0),
    Param("mirostat_tau", "number", "Mirostat's target surprise (bits per token)", lo=0.0, hi=100.0, default=5.0),
    Param("mirostat_eta", "number", "Mirostat's learning rate", lo=0.0, hi=1.0, default=0.1),
    Param("dry_multiplier", "number", "DRY: the repetition penalty's scale; 0 disables", lo=0.0, hi=100.0,
          default=0.0),
    Param("dry_base", "number", "DRY: the penalty's base, raised to the repeat's excess length", lo=1.0, hi=10.0,
          default=1.75),
    Param("dry_allowed_length", "integer", "DRY: repeats up to this long go unpenalized", lo=0, hi=N_CTX,
          default=2),
    Param("dry_penalty_last_n", "integer", "DRY: how many of the context's last tokens it looks at; -1 all",
          lo=-1, hi=N_CTX, default=-1),
)
MAX_BREAKERS = 64            # dry_sequence_breakers' strings (each costs a scan of the vocabulary, once)

# the other scalars both endpoints take
COMMON = (
    Param("n", "integer", "Number of choices, generated in parallel from one prefill of the prompt "
          "(at most the server's --max-choices and its slots)", lo=1, hi=MAX_CHOICES, default=1),
    _flag("stream", False, "Answer with a stream of server-sent events"),
    _flag("cache_prompt", True, "Reuse the longest cached prefix of the prompt"),
    _flag("cache_pin", False, "Keep this prompt pinned in the RAM and disk prompt caches"),
    _flag("return_progress", False, "Streamed: report the prompt's processing (llama-server's prompt_progress)"),
    _flag("timings_per_token", False, "Streamed: each chunk carries the request's timings so far (llama-server's)"),
    Param("speculate", "string", "Speculative decoding for this request (default: the server's setting)",
          enum=SPECULATE_MODES),
)

CHAT = _table(*SAMPLING, *SAMPLERS, *COMMON,
              _flag("logprobs", False, "Report the log-probability of each generated token"),
              Param("top_logprobs", "integer", "With logprobs, also this many most likely alternatives",
                    lo=0, hi=MAX_TOP_LOGPROBS, default=0),
              _flag("parallel_tool_calls", True, "Allow several tool calls in one answer"),
              Param("continue_final_message", "boolean", "Continue the last message's text instead of "
                    "starting a new turn (vLLM's option; default: true when the last message is the "
                    "assistant's, which is then a prefill, as llama-server does)"),
              Param("add_generation_prompt", "boolean", "End the prompt with the template's opening of "
                    "an assistant turn (default: unless the final message is continued)"))

COMPLETION = _table(
    *SAMPLING, *SAMPLERS, *COMMON,
    # the legacy API: an int, how many alternatives (0: the chosen token's alone)
    Param("logprobs", "integer", "Report log-probabilities with this many most likely alternatives",
          lo=0, hi=MAX_COMPLETION_LOGPROBS),
) | {"max_tokens": dataclasses.replace(MAX_TOKENS, default=16, help="Most tokens to generate")}  # OpenAI's

STREAM_OPTIONS = _table(_flag("include_usage", False, "End the stream with a chunk carrying the usage"))

# llama-server's /tokenize
TOKENIZE = _table(_flag("add_special", False, "Add the model's special tokens (BOS) as it would"),
                  _flag("parse_special", True, "Read special tokens written in the text as such"),
                  _flag("with_pieces", False, "Answer each token id with its text piece"))
