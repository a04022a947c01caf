"""The disk tier's write-behind queue: a spill hands its state to the writer thread and returns
(a write held on an Event shows it), a state is found while it waits for its file, a full
queue skips and counts, shutdown drains, a failed write loses that state only; and, on the
real model, a hit served from the queue gives exactly the cold answer."""
from __future__ import annotations

import threading
from pathlib import Path

from appliance.config import EngineConfig
from appliance.engine.cache.disk import MAX_WRITE_ERRORS, DiskTier
from appliance.engine.cache.prompt_cache import PromptCache
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Request, SamplingParams

from .fake_runner import FakeRunner
from .runner_kinds import make_runner
from .test_prefix_cache import FOLLOW, OTHER, STORY, greedy

WAIT_S = 30.0   # what a test waits at most for the writer thread: a hang fails, never blocks


class HeldDisk(DiskTier):
    """A disk tier whose file writes wait for `release` (each sets `writing` first), and fail
    with an OSError for a blob that starts with b"bad"."""

    def __init__(self, *args, **kwargs) -> None:
        self.writing, self.release = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def _write_file(self, path: Path, header: bytes, blob: bytes) -> None:
        self.writing.set()
        assert self.release.wait(WAIT_S), "the test never released the write"
        if blob.startswith(b"bad"):
            raise OSError(28, "No space left on device")
        super()._write_file(path, header, blob)


def held(tmp_path: Path, queue_bytes: int = 1000, max_bytes: int = 100_000) -> HeldDisk:
    return HeldDisk(tmp_path, max_bytes, block=4, fingerprint="m", queue_bytes=queue_bytes)


def test_put_returns_while_the_write_is_held_and_a_lookup_still_hits(tmp_path):
    disk = held(tmp_path)
    blob = b"state" * 40
    assert disk.put(list(range(12)), blob)                 # returns with the write held
    assert disk.writing.wait(WAIT_S) and not disk.release.is_set()
    assert disk.holds(list(range(12))) and not list(tmp_path.glob("*.kv"))
    n, _, got, _ = disk.lookup(list(range(8)) + [99])
    assert n == 8 and got is blob                           # served from the queue, the very bytes
    assert disk.stats()["disk_queued_bytes"] == len(blob)
    disk.release.set()
    assert disk.drain(WAIT_S)
    assert len(list(tmp_path.glob("*.kv"))) == 1 and disk.stats()["disk_queued_bytes"] == 0
    disk.close()
    assert DiskTier(tmp_path, 100_000, "m", 4).lookup(list(range(12)))[2] == blob   # a restart


def test_a_full_queue_skips_and_counts_and_an_empty_one_takes_any_size(tmp_path):
    disk = held(tmp_path, queue_bytes=150)
    assert disk.put([1] * 4, b"a" * 100)                    # being written, still queued
    assert disk.writing.wait(WAIT_S)
    assert not disk.put([2] * 4, b"b" * 100)                # 200 > 150: skipped, not waited for
    assert disk.put([3] * 4, b"c" * 40)                     # fits beside the first
    assert disk.stats()["disk_skipped"] == 1 and not disk.holds([2] * 4) and disk.holds([3] * 4)
    disk.release.set()
    assert disk.drain(WAIT_S)
    assert disk.put([4] * 4, b"d" * 500)                    # larger than the queue, which is empty
    assert disk.drain(WAIT_S) and disk.lookup([4] * 4)[0] == 4
    assert [disk.holds([k] * 4) for k in (1, 2, 3, 4)] == [True, False, True, True]
    disk.close()


def test_put_may_wait_for_room_when_asked(tmp_path):
    disk = held(tmp_path, queue_bytes=150)
    disk.put([1] * 4, b"a" * 100)
    assert disk.writing.wait(WAIT_S)
    threading.Timer(0.2, disk.release.set).start()
    assert disk.put([2] * 4, b"b" * 100, wait_s=WAIT_S)     # shutdown's way: room comes
    assert disk.drain(WAIT_S) and disk.stats()["disk_skipped"] == 0
    disk.close()


def test_a_failed_write_is_logged_and_counted_and_loses_nothing_else(tmp_path, caplog):
    disk = held(tmp_path)
    disk.release.set()
    disk.put([1] * 4, b"old" * 10)
    assert disk.drain(WAIT_S)
    with caplog.at_level("WARNING", logger="appliance.prefix_cache"):
        for k, blob in ((2, b"good" * 10), (3, b"bad" * 10), (4, b"fine" * 10)):
            disk.put([k] * 4, blob)
        assert disk.drain(WAIT_S)
    assert "No space left" in caplog.text and disk.stats()["disk_write_errors"] == 1
    assert disk.enabled and not list(tmp_path.glob("*.tmp"))
    assert [disk.holds([k] * 4) for k in (1, 2, 3, 4)] == [True, True, False, True]
    assert disk.lookup([4] * 4 + [9])[::2] == (4, b"fine" * 10) and disk.lookup([1] * 4)[::2] == (4, b"old" * 10)
    disk.close()


def test_failed_writes_in_a_row_turn_the_tier_off(tmp_path, caplog):
    disk = held(tmp_path)
    disk.release.set()
    with caplog.at_level("WARNING", logger="appliance.prefix_cache"):
        for k in range(MAX_WRITE_ERRORS):
            disk.put([k] * 4, b"bad" * 10)
            assert disk.drain(WAIT_S)
    assert not disk.enabled and "disk tier off" in caplog.text
    assert not disk.put([9] * 4, b"x" * 10)
    disk.close()


# -- through the prompt cache -----------------------------------------------------------------

def fake_sched(tmp_path: Path, n_slots: int = 1) -> tuple[Scheduler, FakeRunner, HeldDisk]:
    runner = FakeRunner(n_slots=n_slots, n_ctx=256)
    cfg = EngineConfig(n_slots=n_slots, n_ctx=256, prefill_chunk=4, step_token_budget=8, cache_ram_bytes=0)
    disk = held(tmp_path)
    return Scheduler(runner, cfg, lambda e: None, PromptCache.from_config(runner, cfg, disk)), runner, disk


def run(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=2), prompt="x"), prompt)
    while sched.has_work():
        sched.step()


def test_a_spill_does_not_wait_for_its_write_and_the_next_turn_hits_the_queue(tmp_path):
    sched, runner, disk = fake_sched(tmp_path)   # no RAM tier: a hit can only come from the disk tier
    a = list(range(1, 14))
    run(sched, "a", a)
    run(sched, "b", [30] * 9)                    # needs the only slot: a's 12 kept tokens spill
    assert disk.writing.wait(WAIT_S) and not disk.release.is_set() and not disk.files
    run(sched, "c", a + [50])                    # while a's file is still being written (b's spills too)
    assert sched.cache.hit_tokens == 12 and disk.hits == 1 and runner.kv[0][:14] == a + [50]
    disk.release.set()
    assert disk.drain(WAIT_S) and len(disk.files) == 2 and disk.lookup(a)[0] == 12
    sched.cache.close()


def test_a_file_is_read_only_when_it_holds_more_than_the_slot_already_does(tmp_path):
    # a conversation saved while it idled, then its next turn in the same slot: the slot holds
    # all the file does, so the file is not read (a whole state, checked) on the way to the
    # first token; once another prompt took the slot, the same turn reads it
    sched, runner, disk = fake_sched(tmp_path)
    disk.release.set()
    reads = []
    read = disk._read
    disk._read = lambda owner, path: reads.append(path) or read(owner, path)
    a = list(range(1, 14))
    run(sched, "a", a)
    assert sched.cache.persist_one() and disk.drain(WAIT_S) and len(disk.files) == 1
    run(sched, "a2", a + [50, 51])
    assert sched.cache.hit_tokens == 12 and disk.hits == 0 and reads == []
    run(sched, "b", [30] * 9)
    run(sched, "c", a + [60])
    assert disk.hits == 1 and len(reads) == 1 and runner.kv[0][:14] == a + [60]
    sched.cache.close()


def test_persist_at_stop_drains_the_writer_within_its_timeout(tmp_path, caplog):
    sched, runner, disk = fake_sched(tmp_path, n_slots=2)
    run(sched, "a", list(range(1, 10)))
    run(sched, "b", list(range(50, 59)))
    with caplog.at_level("WARNING", logger="appliance.prefix_cache"):
        assert not sched.cache.persist(timeout_s=0.2)   # the write is held: time runs out, no hang
    assert "not enough" in caplog.text
    disk.release.set()
    assert sched.cache.persist(timeout_s=WAIT_S)        # what was left is written
    assert len(disk.files) == 2 and disk.stats()["disk_queued_bytes"] == 0
    sched.cache.close()
    assert not disk._writer.is_alive()
    assert not list(tmp_path.glob("*.tmp")) and len(list(tmp_path.glob("*.kv"))) == 2


def test_idle_write_behind_keeps_one_state_in_flight(tmp_path):
    sched, runner, disk = fake_sched(tmp_path, n_slots=2)
    run(sched, "a", list(range(1, 10)))
    run(sched, "b", list(range(50, 59)))
    idle_work = lambda: (sched.cache.stats().unsaved_slots, sched.cache.stats().disk_queued_bytes > 0)  # noqa: E731
    assert idle_work() == (2, False)                    # /health's idle work left: two states to hand over
    assert sched.cache.persist_one() and disk.writing.wait(WAIT_S)
    assert idle_work() == (1, True)
    assert not sched.cache.persist_one()                # the writer is busy: the next idle tick
    disk.release.set()
    assert disk.drain(WAIT_S) and sched.cache.persist_one() and disk.drain(WAIT_S)
    assert not sched.cache.persist_one() and len(disk.files) == 2
    assert idle_work() == (0, False)                    # nothing left: an A/B bench goes on
    sched.cache.close()


# -- on the real model ------------------------------------------------------------------------

def test_a_hit_served_from_the_queue_is_exactly_the_cold_answer(tmp_path):
    from appliance.models import embedded_model_path

    cfg = EngineConfig(n_slots=1, n_ctx=1024, prefill_chunk=128, cache_ram_bytes=0)
    runner = make_runner("llamacpp", cfg, embedded_model_path(), "smol")
    disk = held(tmp_path, queue_bytes=1 << 30, max_bytes=1 << 30)
    events = []
    sched = Scheduler(runner, cfg, events.append, PromptCache.from_config(runner, cfg, disk))

    try:
        greedy(sched, runner, events, "a", STORY)
        greedy(sched, runner, events, "b", OTHER)  # spills a
        assert disk.writing.wait(WAIT_S) and not disk.files
        warm = greedy(sched, runner, events, "c", FOLLOW)
        cold = greedy(sched, runner, events, "d", FOLLOW, cache=False)
        assert warm[2] >= 256 and disk.hits == 1 and cold[2] == 0
        assert warm[0] == cold[0] and warm[1] == cold[1]
    finally:
        disk.release.set()
        disk.drain(WAIT_S)
        sched.cache.close()
        runner.close()
