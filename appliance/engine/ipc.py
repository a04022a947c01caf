"""The messages that cross the pipes between the server process and the engine process.

    server -> engine (cmd pipe)      Submit, Abort, Tokenize, Detokenize, RenderPrompt, Embed,
                                     GetSlots, SlotAction, Stop
    engine -> server (event pipe)    Ready or LoadFailed once; then StepEvents, one per step

Every message is a frozen dataclass (it pickles across the boundary and cannot change on the
way), and each side dispatches them with `match`, so an unknown message is a loud error and
a field is read by name, never by tuple position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .runners.base import RunnerInfo
from .stats import EngineStats
from .types import Event, Request


# -- commands: server -> engine -------------------------------------------------------------

@dataclass(frozen=True)
class Submit:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Tokenize:
    """llama-server's /tokenize, answered between steps with one `Tokenized` event."""

    request_id: str
    text: str
    add_special: bool
    parse_special: bool
    with_pieces: bool


@dataclass(frozen=True)
class Detokenize:
    request_id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """Write idle slots' prompt states to disk, release the model, exit."""


@dataclass(frozen=True)
class RenderPrompt:
    """The prompt a request would be given (its chat template rendered, tools included, and
    tokenized), answered between steps with one `Tokenized` event (ids and text); nothing is
    generated. For token counting (Anthropic's count_tokens) and llama-server's /apply-template."""

    request_id: str
    request: Request


@dataclass(frozen=True)
class Embed:
    """A vector per input (a text, which the engine tokenizes, or token ids), answered with one
    `Embedded` event once every input's vector is computed, or one `Error`. The inputs are
    batched with other requests' and run one batch per loop turn (engine/embed.py)."""

    request_id: str
    # a text, token ids, or llama-server's mix of both (its texts tokenized in place; the model's
    # BOS only before a first piece that is text)
    inputs: tuple[str | tuple[int | str, ...], ...]
    truncate: bool = False           # cut an input longer than the model takes, instead of refusing it
    dimensions: int | None = None    # refused unless the model's own size
    normalize: bool = True           # as llama-server's and OpenAI's vectors are
    norm: int = 2                    # llama-server's embd_normalize: 2 L2, 1 taxicab, 0 max-abs to int16, p > 2
    per_token: bool = False          # a vector per token where the model pools none (llama-server's /embeddings)


@dataclass(frozen=True)
class GetSlots:
    """llama-server's GET /slots: answered between steps with one `Slots` event."""

    request_id: str


@dataclass(frozen=True)
class SlotAction:
    """llama-server's POST /slots/ID?action=save|restore|erase: one `SlotDone` event (or an
    `Error`), once the slot is idle (an action on a busy slot waits for its request to end, as
    llama-server defers it). `filename`: a plain name in --slot-save-path (save, restore)."""

    request_id: str
    slot: int
    action: str
    filename: str = ""


Command = Submit | Abort | Tokenize | Detokenize | RenderPrompt | Embed | GetSlots | SlotAction | Stop


# -- replies: engine -> server --------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    info: RunnerInfo
    stats: EngineStats


@dataclass(frozen=True)
class LoadFailed:
    """The model could not be loaded; `kind` names a class in appliance.errors."""

    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepEvents:
    """The events of one scheduler step (or of commands answered between steps), and the
    engine's statistics when they are due (about ten times a second)."""

    events: tuple[Event, ...]
    stats: EngineStats | None = None


Reply = Ready | LoadFailed | StepEvents
