"""A first start on a machine does not wait for the CPU kernels' build: the torch runner serves
on torch ops while the compiler runs at the lowest priority, and the engine moves to the
kernels when it is next idle (`TorchRunner.upgrade`, `startup.upgrade`, `EngineLoop._upgrade`).

The build is held by a gate here (the real build, behind an event), so each state is seen:
building, built but busy (admission held), moved. After the move the engine computes what an
engine started on built kernels computes, bit for bit, and nothing kept from before is reused."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.ipc import Ready  # noqa: E402
from appliance.engine.loop import EngineLoop  # noqa: E402
from appliance.engine.runners import make_runner  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.runners.torch import cpu_kernels  # noqa: E402
from appliance.engine.runners.torch.runner import BUILDING  # noqa: E402
from appliance.engine.types import Delta, Done, Error, Request, SamplingParams  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    built, why = cpu_kernels.load()   # the real build, once: the gated builds below then only load it
    assert built is not None, f"the kernels did not build on this machine: {why}"
    return write_tiny(tmp_path_factory.mktemp("deferred") / "m.gguf", "llama", n_ctx=1024)


class Gate:
    """cpu_kernels as on a machine that never built them: `built()` is False and the build
    (the real one) waits for `open()`; `priority` is the build thread's nice value."""

    def __init__(self, monkeypatch) -> None:
        self.event, self.priority = threading.Event(), None
        real = cpu_kernels._build

        def gated(name):
            self.priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.event.wait(60)
            return real(name)

        monkeypatch.setattr(cpu_kernels, "_build", gated)
        monkeypatch.setattr(cpu_kernels, "built", lambda: False)
        monkeypatch.setattr(cpu_kernels, "_loaded", {})
        monkeypatch.setattr(cpu_kernels, "_building", {})

    def open(self) -> None:
        self.event.set()
        for t in list(cpu_kernels._building.values()):
            t.join(120)


def cfg(path, **kw) -> EngineConfig:
    return EngineConfig(engine="torch", model=str(path), n_slots=2, n_ctx=1024, torch_dtype="float32", plan="off",
                        cache_disk_bytes=0, **kw)


def test_ready_says_whether_load_would_wait(monkeypatch):
    gate = Gate(monkeypatch)
    assert not cpu_kernels.ready()            # nothing started: load() would build
    cpu_kernels.prefetch(background=True)
    assert not cpu_kernels.ready()
    assert gate.priority is None or gate.priority == 19
    gate.open()
    assert cpu_kernels.ready() and gate.priority == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19   # the caller's stays


def test_a_deferred_runner_serves_on_ops_then_moves_to_the_kernels(model, monkeypatch):
    reference = make_runner(cfg(model), model, "m")           # the kernels built: cpp from the start
    gate = Gate(monkeypatch)
    r = make_runner(cfg(model), model, "m", defer_kernels=True)
    try:
        s = r.info.settings
        assert (s["cpu_kernels"], s["attention"], s["cpu_kernels_note"]) == ("building", "ops", BUILDING)
        assert r.model.blocks[0].attn.cpu is None and r.model.rope.cpu is None
        assert gate.priority == 19
        ids = tuple(r.tokenize("The quick brown fox jumps over the lazy dog", add_special=True))
        on_ops = r.forward([Span(0, ids, 0, len(ids))])[0]
        before = r.kv_fingerprint()
        assert not r.upgrade_ready() and not r.upgrade()
        gate.open()
        assert r.upgrade_ready() and r.upgrade()
        s = r.info.settings
        assert (s["cpu_kernels"], s["attention"]) == ("cpp", "cpp") and "cpu_kernels_note" not in s
        assert r.kv_fingerprint() == reference.kv_fingerprint() != before
        assert not r.upgrade_ready() and not r.upgrade()      # once
        r.truncate(0, 0)
        got = r.forward([Span(0, ids, 0, len(ids))])[0]
        want = reference.forward([Span(0, ids, 0, len(ids))])[0]
        assert np.array_equal(got, want)
        assert not np.array_equal(got, on_ops)     # other arithmetic: why the KV kept before is dropped
    finally:
        r.close()
        reference.close()


def test_only_a_first_build_is_deferred(model):
    """Built kernels are loaded at once (cpp from the start), deferred or not; `cpp` waits."""
    r = make_runner(cfg(model), model, "m", defer_kernels=True)
    try:
        assert r.info.settings["cpu_kernels"] == "cpp" and not r.upgrade_ready()
    finally:
        r.close()


def test_cpp_asked_for_waits_for_the_build(model, monkeypatch):
    gate = Gate(monkeypatch)
    threading.Timer(0.5, gate.event.set).start()
    r = make_runner(cfg(model, torch_cpu_kernels="cpp"), model, "m", defer_kernels=True)
    try:
        assert r.info.settings["cpu_kernels"] == "cpp" and gate.priority != 19
    finally:
        r.close()


def request(i: int, text: str) -> Request:
    return Request(f"r{i}", prompt=text, params=SamplingParams(temperature=0.0, max_tokens=12))


def drain(loop: EngineLoop, out: dict) -> None:
    for e in loop.outbox:
        assert not isinstance(e, Error), e
        if isinstance(e, Delta):
            out.setdefault(e.request_id, []).extend(e.token_ids)
        elif isinstance(e, Done):
            out.setdefault("done", []).append(e.request_id)
    loop.outbox.clear()


class Pipe:
    def __init__(self) -> None:
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)


TEXT = "Once upon a time, in a small village by the sea, there lived"


def test_the_engine_moves_when_no_request_runs_and_holds_new_ones_meanwhile(model, monkeypatch):
    gate = Gate(monkeypatch)
    loop = EngineLoop(cfg(model))
    pipe, out = Pipe(), {}
    try:
        assert loop.info.settings["cpu_kernels"] == "building"
        loop.submit(request(1, TEXT))
        loop.scheduler.step()                     # r1 runs, on torch ops
        gate.open()
        loop.submit(request(2, TEXT))
        assert loop._upgrade(pipe) and not pipe.sent
        assert loop.scheduler.holding             # r2 waits for the move
        while loop.scheduler.running():
            loop.scheduler.step()
            assert "r2" not in [a.req.id for a in loop.scheduler.slots if a is not None]
        drain(loop, out)
        assert out["done"] == ["r1"] and len(loop.scheduler.waiting) == 1
        assert loop._upgrade(pipe)
        assert [type(m) for m in pipe.sent] == [Ready]
        assert pipe.sent[0].info.settings["cpu_kernels"] == "cpp" == loop.info.settings["cpu_kernels"]
        assert "cpu_kernels_note" not in loop.info.settings
        assert not loop.scheduler.holding and loop.scheduler.cache.stats().cached_tokens == 0
        while loop.scheduler.has_work():
            loop.scheduler.step()
        drain(loop, out)
        assert out["done"] == ["r1", "r2"]
        assert loop._upgrade(pipe) and len(pipe.sent) == 1    # once
    finally:
        loop.close()
    # r2 decoded as an engine started on built kernels decodes it
    monkeypatch.undo()
    fresh = EngineLoop(cfg(model))
    try:
        assert fresh.info.settings["cpu_kernels"] == "cpp"
        want = {}
        fresh.submit(request(2, TEXT))
        while fresh.scheduler.has_work():
            fresh.scheduler.step()
        drain(fresh, want)
        assert out["r2"] == want["r2"] and len(want["r2"]) == 12
        assert {k: v for k, v in fresh.info.settings.items() if k != "speculation"} == \
               {k: v for k, v in loop.info.settings.items() if k != "speculation"}
    finally:
        fresh.close()


def test_a_build_left_running_by_a_stopped_engine_is_waited_for(tmp_path, monkeypatch):
    """An engine stopped during a first build leaves its ninja and compiler running (without
    its flock): the next build waits for them instead of writing the same files beside them."""
    import subprocess
    import time

    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = cpu_kernels.cache_dir() / "appliance_cpu_kernels_orphan_test"
    where.mkdir(parents=True)
    orphan = subprocess.Popen(["sleep", "1.5"], cwd=where)
    seen = []
    monkeypatch.setattr(ext, "load", lambda **kw: seen.append(orphan.poll()) or "module")
    try:
        assert cpu_kernels._working_in(where) == [orphan.pid]
        t0 = time.monotonic()
        assert cpu_kernels._build(where.name) == ("module", "")
        assert seen == [0] and time.monotonic() - t0 > 1.0    # built after the orphan ended
        assert cpu_kernels._working_in(where) == []
    finally:
        orphan.kill()
        orphan.wait()
