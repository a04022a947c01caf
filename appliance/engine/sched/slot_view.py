"""The slots as llama-server's GET /slots shows them: each slot's request (or, idle, the last
one it served, as llama-server keeps a slot's previous task), and the positions it holds: a busy
slot's computed ones, an idle slot's what the prompt cache keeps of it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import SlotState
from .request_state import Active

if TYPE_CHECKING:
    from .scheduler import Scheduler


def slot_states(sched: Scheduler) -> tuple[SlotState, ...]:
    return tuple(_state(sched, i) for i in range(len(sched.slots)))


def _state(sched: Scheduler, slot: int) -> SlotState:
    busy = sched.slots[slot]
    act = busy or sched.last[slot]
    held = busy.n_past if busy is not None else len(sched.cache.kept[slot])
    base = SlotState(slot, sched.n_ctx, sched.spec.policy.allowed, busy is not None, held)
    if act is None:
        return base
    return SlotState(slot, sched.n_ctx, act.spec is not None if busy else base.speculative, busy is not None, held,
                     id_task=act.task, params=act.req.params,
                     n_prompt_tokens_processed=max(0, min(act.n_past, len(act.prompt)) - act.cached),
                     n_prompt_tokens_cache=act.cached, n_decoded=act.output.n_generated,
                     n_remain=_remain(act), has_next_token=busy is not None,
                     has_new_line=b"\n" in sched.runner.detokenize(act.out))


def _remain(act: Active) -> int:
    """Tokens it may still generate, -1 where the request set no max_tokens (llama-server's n_remain)."""
    asked = act.req.params.max_tokens
    return -1 if asked is None else max(0, asked - act.output.n_generated)
