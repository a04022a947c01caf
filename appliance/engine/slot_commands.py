"""llama-server's slot routes inside the engine, carried out between steps: GET /slots's view
(sched/slot_view.py) and the save, restore and erase actions (cache/slot_files.py).

An action on a slot a request holds waits until that request ends, as llama-server defers it;
the engine loop asks `due` every turn, before the next step, and a request waiting for a slot is
admitted only at that step, so a waiting action runs in the pause its slot is freed in. A client
that gives up (the server's answer timeout) aborts it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InvalidRequest, NotSupported
from .cache.slot_files import NO_SAVE_PATH, SlotFiles
from .ipc import GetSlots, SlotAction
from .sched.scheduler import Scheduler
from .sched.slot_view import slot_states
from .types import Error, Event, SlotDone, Slots

ACTIONS = ("save", "restore", "erase")


class SlotCommands:
    """`failed(request_id, exception)`: the Error event for an action that could not be done."""

    def __init__(self, scheduler: Scheduler, save_path: str | None,
                 failed: Callable[[str, Exception], Error]) -> None:
        self.scheduler, self.failed = scheduler, failed
        self.files = SlotFiles(Path(save_path).expanduser() if save_path else None)
        self.waiting: list[SlotAction] = []

    def slots(self, msg: GetSlots) -> Slots:
        return Slots(msg.request_id, slot_states(self.scheduler))

    def act(self, msg: SlotAction) -> Event | None:
        """The action's answer, or None while its slot is busy (then `due` answers it)."""
        try:
            if self.files.root is None:          # erase too, as llama-server answers
                raise NotSupported(NO_SAVE_PATH)
            if msg.action not in ACTIONS:
                raise InvalidRequest(f"Invalid action {msg.action!r}: one of {', '.join(ACTIONS)}", param="action")
            if not 0 <= msg.slot < len(self.scheduler.slots):
                raise InvalidRequest(f"Invalid slot ID {msg.slot}: this server has slots 0 to "
                                     f"{len(self.scheduler.slots) - 1}", param="id_slot")
            if msg.action != "erase":
                self.files.path(msg.filename)    # a refused name or no --slot-save-path: answered now
            if self.scheduler.slots[msg.slot] is not None:
                self.waiting.append(msg)
                return None
            return self._do(msg)
        except Exception as e:
            return self.failed(msg.request_id, e)

    def due(self) -> list[Event]:
        """The waiting actions whose slot is idle now, done, in the order they came."""
        if not self.waiting:
            return []
        ready = [m for m in self.waiting if self.scheduler.slots[m.slot] is None]
        self.waiting = [m for m in self.waiting if m not in ready]
        return [e for e in map(self.act, ready) if e is not None]

    def abort(self, request_id: str) -> None:
        self.waiting = [m for m in self.waiting if m.request_id != request_id]

    def _do(self, msg: SlotAction) -> SlotDone:
        cache = self.scheduler.cache
        if msg.action == "erase":
            return SlotDone(msg.request_id, msg.action, msg.slot, n_tokens=cache.erase(msg.slot))
        move = self.files.save if msg.action == "save" else self.files.restore
        moved = move(cache, msg.slot, msg.filename)
        return SlotDone(msg.request_id, msg.action, msg.slot, msg.filename, moved.n_tokens, moved.n_bytes, moved.ms)
