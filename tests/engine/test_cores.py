"""Sharing the cores (engine/cores.py): engines that share a turns file take the cores one step
at a time and alternate; an engine that dies holding its turn frees it; idle work runs only
when no other engine has a turn and the machine's other processes are quiet."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from appliance.engine import cores
from appliance.engine.cores import Neighbours, Turns
from appliance.engine.loop import EngineLoop

STEP_S = 0.004


def _steps(path: str, name: str, until: float, log) -> None:
    turns = Turns(path)
    while time.time() < until:
        with turns.turn():
            log.put(name)
            t = time.perf_counter()
            while time.perf_counter() - t < STEP_S:   # a step's work, on the cores
                pass
        t = time.perf_counter()
        while time.perf_counter() - t < STEP_S / 20:  # the loop's own between steps
            pass


def test_two_busy_engines_alternate_step_by_step(tmp_path):
    ctx = mp.get_context("spawn")
    log, path, until = ctx.Queue(), str(tmp_path / "turns.lock"), time.time() + 2.5
    procs = [ctx.Process(target=_steps, args=(path, n, until, log)) for n in "AB"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    order = []
    while not log.empty():
        order.append(log.get())
    a, b = order.count("A"), order.count("B")
    assert a + b > 50 and min(a, b) >= 0.4 * (a + b), (a, b)   # each about half: turns, not a race


def _hold(path: str, ready) -> None:
    turns = Turns(path)
    with turns.turn():
        ready.set()
        time.sleep(600)


def test_an_engine_that_dies_holding_its_turn_frees_it(tmp_path):
    ctx = mp.get_context("spawn")
    path, ready = str(tmp_path / "turns.lock"), ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, ready))
    holder.start()
    assert ready.wait(60)
    mine = Turns(path)
    with mine.idle_turn() as got:
        assert not got                       # another engine computes: no idle work now
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    t0 = time.monotonic()
    with mine.turn():                        # the kernel let go of the dead engine's lock
        assert time.monotonic() - t0 < 5
    with mine.idle_turn() as got:
        assert got


def test_alone_there_is_no_lock_and_idle_work_may_always_run():
    alone = Turns(None)
    with alone.turn():
        pass
    with alone.idle_turn() as got:
        assert got and alone.fd is None


def test_neighbours_are_what_the_machine_ran_besides_this_process(monkeypatch):
    clock, machine, own = [100.0], [(1000, 5000)], [200]
    monkeypatch.setattr(cores.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cores, "_busy_ticks", lambda: machine[0])
    monkeypatch.setattr(cores, "_own_ticks", lambda: own[0])
    monkeypatch.setattr(cores.os, "sysconf", lambda name: 100)        # 100 ticks a second
    n = Neighbours()
    clock[0], machine[0], own[0] = 100.1, (1018, 5020), 210     # 0.18 s busy, 0.10 of it ours
    assert n.busy()                                              # 0.08 core-s in 0.1 s: 0.8 cores
    clock[0], machine[0], own[0] = 100.2, (1028, 5040), 219     # 0.10 busy, 0.09 ours
    assert not n.busy()                                          # 0.1 cores
    clock[0] = 100.22
    assert not n.busy()                                          # too short a window: the last verdict
    clock[0], machine[0] = 101.5, (1030, 5300)                   # not looked at for 1.3 s
    assert n.busy()                                              # say busy, look again
    clock[0], machine[0] = 101.6, (1030, 5320)
    assert not n.busy()


def test_a_process_spinning_beside_is_seen():
    ctx = mp.get_context("spawn")
    spinner = ctx.Process(target=_spin, args=(3.0,))
    spinner.start()
    try:
        n = Neighbours()
        time.sleep(0.3)
        n.busy()                   # a fresh window
        time.sleep(0.3)
        assert n.busy()
    finally:
        spinner.join(10)


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


class Cache:
    def __init__(self, settling: bool) -> None:
        self.settling, self.settled, self.saved = settling, 0, 0

    def settle_one(self) -> None:
        self.settled += 1

    def persist_one(self) -> None:
        self.saved += 1


class Scheduler:
    def __init__(self, settling: bool) -> None:
        self.cache = Cache(settling)


def loop_with(settling: bool, busy: bool, turns: Turns) -> EngineLoop:
    """An EngineLoop's idle-work state alone (no model): its scheduler's cache and neighbours."""
    loop = EngineLoop.__new__(EngineLoop)
    loop.scheduler, loop.turns, loop._idle_retry_at = Scheduler(settling), turns, 0.0
    loop.neighbours = type("N", (), {"busy": lambda self: busy})()
    return loop


@pytest.mark.parametrize("settling", [True, False], ids=["settle", "write-behind"])
def test_idle_work_waits_while_the_machine_computes_and_runs_when_it_is_quiet(settling):
    idle_since = time.monotonic() - 5
    busy = loop_with(settling, busy=True, turns=Turns(None))
    busy._idle_work(idle_since)
    assert (busy.scheduler.cache.settled, busy.scheduler.cache.saved) == (0, 0)
    assert busy._idle_retry_at > time.monotonic()            # and it looks again later, not at once
    quiet = loop_with(settling, busy=False, turns=Turns(None))
    quiet._idle_work(idle_since)
    assert (quiet.scheduler.cache.settled, quiet.scheduler.cache.saved) == ((1, 0) if settling else (0, 1))


def test_idle_work_waits_while_another_engine_has_its_turn(tmp_path):
    ctx = mp.get_context("spawn")
    path, ready = str(tmp_path / "turns.lock"), ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, ready))
    holder.start()
    try:
        assert ready.wait(60)
        loop = loop_with(True, busy=False, turns=Turns(path))
        loop._idle_work(time.monotonic() - 5)
        assert loop.scheduler.cache.settled == 0
    finally:
        holder.kill()
        holder.join(10)
