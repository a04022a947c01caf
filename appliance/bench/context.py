"""What a plan of `sweep` or `bench` is built from: the servers and references the run opened
(Context), what `bench` was asked to measure (BenchOptions), the routes cells are measured on,
and a value one repeat's steps share (`once`). plans.py and agent.py build steps from these."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import prompt_sets
from .raw import RawReference
from .session import Prompts, Variant

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Context:
    """What a plan is built from: the servers the run opened, the raw reference (or None), the host
    sampler, and the prompt maker of the first server."""

    variants: list[Variant]
    raw: RawReference | None
    sampler: Any
    prompts: Prompts

    @property
    def n_ctx(self) -> int:
        known = [v.n_ctx for v in self.variants if v.n_ctx]
        return min(known) if known else 0

    @property
    def n_slots(self) -> int:
        return min(v.n_slots for v in self.variants)


def once(make: Callable[[], Any]) -> Callable[[], Any]:
    """A value built on first use and shared by the steps of one repeat (the same prompt for
    raw and served, A and B)."""
    box: list[Any] = []

    def get() -> Any:
        if not box:
            box.append(make())
        return box[0]
    return get


@dataclass(frozen=True)
class BenchOptions:
    """What `appliance bench` was asked to measure."""

    modes: tuple[str, ...] = ("serial",)
    prompt_sets: tuple[str, ...] = prompt_sets.DEFAULT_SETS
    tokens: int = 128
    runs: int = 3
    depths: tuple[int, ...] | None = ()       # empty: half the context; None: no depth rows
    concurrency: tuple[int, ...] = (1, 2, 4)
    concurrency_prompt_tokens: int = 512
    agent_conversations: int = 1
    agent_turns: int = 8
    agent_system_tokens: int = 2000
    agent_turn_tokens: int = 300
    agent_tools: int | None = None             # the first N of the tool-calls set's tools (None: all)
    agent_reply_tokens: int = 24
    agent_tool_ms: int = 0                     # the client waits this long before each follow-up (a tool runs)
    agent_restart: bool = False                # restart the server after the replay, then one more turn each
    needle_lengths: tuple[int, ...] | None = None   # None: fractions of the context; () = off
