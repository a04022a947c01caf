"""Typed data crossing the server <-> engine boundary: requests in, events out.

Every request's first event is `Accepted` or `Error`; then, when it asked (return_progress),
`Progress` as its prompt is processed; then `Delta`s (of every choice, each with its `index`,
when it asked for n > 1); then exactly one `Done` or `Error`. A tokenize or
detokenize command gets exactly one `Tokenized` or `Error`, an embed command one `Embedded` or
`Error`, a slots command one `Slots`, a slot action one `SlotDone` or `Error`. Everything here is a frozen dataclass so it pickles across
the process boundary and cannot be changed on the way.
"""
from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from .sampling_params import SAMPLER_ORDER, SamplingParams  # noqa: F401 - crosses the boundary in Request

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
IMAGE_MARKER = "<__media__>"    # where an image goes in a prompt's text (llama-server's marker)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters_json: str    # a JSON schema, serialized


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # a JSON object, serialized (as OpenAI sends it)


@dataclass(frozen=True)
class ToolCallPart:
    """A piece of a tool call as it streams: the first part of call `index` (of the reply) has
    its id and name and no arguments; later parts carry the arguments' text as the model writes
    it, so a call's parts' arguments concatenate to a JSON object's text."""
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None    # an assistant's earlier thinking, for templates that keep it


@dataclass(frozen=True)
class Constraint:
    """Output must match: kind "json_object" (any JSON object), "json_schema" (schema_json), "lark"
    (a tool-call grammar) or "gbnf" (llama-server's `grammar`, in schema_json)."""

    kind: str
    schema_json: str | None = None


@dataclass(frozen=True)
class ImageInput:
    """A picture for a model with a projector, decoded by the server (web/images.py): RGB
    bytes, row-major, `width` x `height` x 3. `digest` (sha256 of size and pixels) is its
    content's name: the prompt cache knows a picture by it."""

    digest: str
    width: int
    height: int
    rgb: bytes


@dataclass(frozen=True)
class Request:
    """Exactly one of `messages` (chat), `prompt` (text) or `prompt_ids` (tokens) is set.
    `images`, in order, go where the rendered prompt's text has IMAGE_MARKER, one each.

    The engine renders the chat template and tokenizes: the server never does.
    """

    id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    add_generation_prompt: bool = True
    continue_final: bool = False    # the last (assistant) message is continued: a prefill
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    constraint: Constraint | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"       # auto | none | required | the name of one tool
    parallel_tool_calls: bool = True
    cache_prompt: bool = True       # may reuse a cached prefix (llama-server's option name)
    cache_pin: bool = False         # keep this prompt's state pinned in the cache tiers
    speculate: str | None = None    # "off" | "lookup" | "draft" | "mtp"; None: the engine's default
    n: int = 1                      # choices: parallel sequences sharing the prompt's one prefill
    reasoning_format: str | None = None   # none | deepseek | auto (llama-server's); None: the server's
    images: tuple[ImageInput, ...] = ()
    return_progress: bool = False   # a Progress event before and after each prompt chunk (llama-server's)
    timings_per_token: bool = False  # each Delta carries the timings so far (llama-server's)
    # LoRA scales by adapter id (llama-server's `lora`: an adapter not listed is at 0); None: the
    # engine's own, the flags' or what POST /lora-adapters set (engine/lora.py resolves it)
    lora: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded LoRA adapter as /lora-adapters lists it: its id (the order of the flags), its file
    and the scale it started at."""

    id: int
    path: str
    scale: float


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Engine-measured times for one request (names follow llama-server's `timings`).

    prompt_ms: from the first prefill chunk to the first sampled token.
    predicted_ms: wall time of the batched steps that produced this request's later tokens;
    predicted_n counts those steps, so predicted_per_second is the engine's decode rate.
    """

    prompt_n: int        # prompt tokens computed for this request (the rest came from the cache)
    cache_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    queue_ms: float
    n_ctx: int
    tokens_per_step: float = 1.0
    draft_n: int = 0              # drafted tokens verified (llama-server's names)
    draft_n_accepted: int = 0     # ... of which accepted
    speculation: str = "off"      # off | lookup | draft | mtp, "-inexact" appended where the runner is not proven exact
    cache_reuse: str = "exact"    # exact (what was reused gives the cold answer) | inexact (--prompt-cache fast)
    expert_hit_rate: float | None = None   # share of its routed experts the expert cache held (None: no cache)

    @property
    def prompt_per_second(self) -> float:
        return 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_n": self.prompt_n, "cache_n": self.cache_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_per_second, 3),
            "predicted_n": self.predicted_n, "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_per_second, 3),
            "queue_ms": round(self.queue_ms, 3), "tokens_per_step": round(self.tokens_per_step, 3),
            "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "speculation": self.speculation, "cache_reuse": self.cache_reuse,
            "n_ctx": self.n_ctx, "depth": self.cache_n + self.prompt_n + self.predicted_n + 1,
            **({"expert_hit_rate": round(self.expert_hit_rate, 4)} if self.expert_hit_rate is not None else {}),
        }


@dataclass(frozen=True)
class Accepted:
    request_id: str
    n_prompt_tokens: int
    n_cached: int = 0


@dataclass(frozen=True)
class Progress:
    """How far a request's prompt is processed (llama-server's prompt_progress), when it asked:
    once as its prefill starts, then after each chunk; `processed` counts the cached positions."""
    request_id: str
    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass(frozen=True)
class TopLogprob:
    token: str
    bytes: tuple[int, ...]
    logprob: float
    id: int = -1                    # the token id (llama-server's n_probs report it)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (raw logits, before any sampling
    transform), with the `top` most likely tokens at that position."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    id: int = -1


@dataclass(frozen=True)
class Delta:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()     # calls complete in this delta (whole-reply answers use these)
    reasoning: str = ""             # text of the reply's leading <think> block
    call_parts: tuple[ToolCallPart, ...] = ()  # the same calls as they stream (streamed answers use these)
    index: int = 0                  # the choice it belongs to (a request with n > 1)
    timings: Timings | None = None  # the request's timings so far, when it asked (timings_per_token)


@dataclass(frozen=True)
class ChoiceEnd:
    """How one choice of a request with n > 1 ended."""

    index: int
    finish_reason: FinishReason
    stop_string: str | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Done:
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_string: str | None = None  # the stop string that ended the reply, when one did
    token_ids: tuple[int, ...] = ()  # the reply's tokens (a Delta's may lag: text held back)
    # with n > 1, every choice's end (the fields above are choice 0's); usage counts the prompt
    # once and every choice's tokens, as OpenAI's does
    choices: tuple[ChoiceEnd, ...] = ()

    def ends(self) -> tuple[ChoiceEnd, ...]:
        """Every choice's end, in index order (one for a request with n = 1)."""
        return self.choices or (ChoiceEnd(0, self.finish_reason, self.stop_string, self.token_ids),)


@dataclass(frozen=True)
class Error:
    """An error for one request; `kind` names a class in appliance.errors."""

    request_id: str
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tokenized:
    """The one event answering a tokenize command (`ids`, and each token's piece as bytes when
    asked) or a detokenize command (`text`)."""

    request_id: str
    ids: tuple[int, ...] = ()
    pieces: tuple[bytes, ...] = ()
    text: str = ""


@dataclass(frozen=True)
class Embedded:
    """The one event answering an embed command: a vector per input, in order, as little-endian
    float32 (`data`: n_inputs x n_embd; OpenAI's base64 encoding is these bytes), and each
    input's token count. With `per_token`, a vector per token of each input (data: sum(n_tokens)
    x n_embd)."""

    request_id: str
    data: bytes
    n_embd: int
    n_tokens: tuple[int, ...]
    per_token: bool = False

    def raw(self, i: int) -> bytes:
        size = 4 * self.n_embd
        return self.data[i * size:(i + 1) * size]

    def floats(self, i: int) -> list[float]:
        vec = array.array("f", self.raw(i))
        if sys.byteorder == "big":
            vec.byteswap()
        return vec.tolist()

    def rows(self, i: int) -> list[list[float]]:
        """Input i's vectors: one per token with `per_token`, else its one vector."""
        if not self.per_token:
            return [self.floats(i)]
        start = sum(self.n_tokens[:i])
        return [self.floats(start + j) for j in range(self.n_tokens[i])]


@dataclass(frozen=True)
class SlotState:
    """One slot as llama-server's GET /slots shows it. `id_task` and what follows it are of the
    request in the slot, or (idle) of the last one it served; None: it has served none."""

    id: int
    n_ctx: int
    speculative: bool
    is_processing: bool
    n_prompt_tokens: int               # positions the slot holds (idle: what the prompt cache keeps)
    id_task: int | None = None
    params: SamplingParams | None = None
    n_prompt_tokens_processed: int = 0
    n_prompt_tokens_cache: int = 0
    n_decoded: int = 0
    n_remain: int = -1                 # tokens it may still generate; -1: no max_tokens given
    has_next_token: bool = False
    has_new_line: bool = False


@dataclass(frozen=True)
class Slots:
    """The one event answering a slots command: every slot, in order."""

    request_id: str
    slots: tuple[SlotState, ...]


@dataclass(frozen=True)
class SlotDone:
    """The one event answering a slot action (llama-server's save, restore, erase): the prompt
    positions the file or the slot held, the file's bytes and the milliseconds it took."""

    request_id: str
    action: str
    slot: int
    filename: str = ""
    n_tokens: int = 0
    n_bytes: int = 0
    ms: float = 0.0


Event = Accepted | Progress | Delta | Done | Error | Tokenized | Embedded | Slots | SlotDone
