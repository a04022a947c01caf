"""The RAM tier: block-chain keys, prefix lookups, the byte bound; and, on the real model,
a prefix restored from RAM gives exactly the cold answer."""
from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.engine.cache.ram import RamTier, block_chain, state_key
from appliance.engine.cache.prompt_cache import PromptCache
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.types import Delta, Done, Request, SamplingParams

from .fake_runner import FakeRunner
from .runner_kinds import KINDS, make_runner


def test_block_chain_keys_depend_on_the_whole_prefix():
    a, b = block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_chain([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # only whole blocks
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4) == a


def test_lookup_finds_the_longest_shared_prefix_to_the_token():
    ram = RamTier(max_bytes=1000, block=4)
    assert ram.put(list(range(12)), b"x" * 100)
    assert ram.lookup(list(range(12)) + [99])[0] == 12
    n, entry = ram.lookup(list(range(6)) + [50, 51])
    assert n == 6 and entry.tokens == tuple(range(12))  # found by a whole block, then token by token
    assert ram.lookup([7, 7, 7, 7, 7])[0] == 0
    assert ram.lookup([0, 1, 2])[0] == 0              # less than a block is never looked for


def test_states_of_any_length_are_told_apart_by_their_tail():
    ram = RamTier(max_bytes=1000, block=4)
    ram.put(list(range(10)), b"a" * 100)             # two whole blocks and a tail of 2
    ram.put(list(range(9)) + [77, 78], b"b" * 100)    # the same blocks, another tail
    assert len(ram.entries) == 2 and ram.holds(list(range(10))) and not ram.holds(list(range(9)))
    found, entry = ram.lookup(list(range(9)) + [77, 78, 5])
    assert found == 11 and entry.blob == b"b" * 100


def test_byte_bound_evicts_the_least_recently_used_of_equals_and_cleans_the_index():
    ram = RamTier(max_bytes=250, block=4)
    ram.put([1] * 4, b"a" * 100)
    ram.put([2] * 4, b"b" * 100)
    ram.lookup([1] * 4)                   # touch the first
    ram.put([3] * 4, b"c" * 100)          # evicts the second
    assert ram.bytes == 200 and ram.lookup([2] * 4)[0] == 0 and ram.lookup([1] * 4)[0] == 4
    assert not ram.put([4] * 4, b"d" * 300)  # bigger than the tier: refused, nothing evicted
    assert len(ram.entries) == 2


def test_scheduler_spills_a_needed_slot_and_restores_it():
    runner = FakeRunner(n_slots=1, n_ctx=256)
    events = []
    sched = Scheduler(runner, EngineConfig(n_slots=1, n_ctx=256, prefill_chunk=4, step_token_budget=4), events.append)

    def go(rid, prompt):
        sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=2), prompt="x"), prompt)
        while sched.has_work():
            sched.step()
        return [e for e in events if isinstance(e, Done) and e.request_id == rid][0]

    a = list(range(1, 14))
    go("a", a)
    go("b", [30] * 9)                     # needs the only slot: a's 12 kept tokens go to RAM
    assert sched.cache.ram.stats()["ram_entries"] == 1
    done = go("c", a + [50])
    assert done.usage.cached_tokens == 12 and sched.cache.ram.hits == 1
    assert runner.kv[0][:14] == a + [50]


@pytest.fixture(scope="module", params=KINDS)
def real(request):
    from appliance.models import embedded_model_path

    cfg = EngineConfig(n_slots=1, n_ctx=1024, prefill_chunk=128)
    runner = make_runner(request.param, cfg, embedded_model_path(), "smol")
    yield runner, cfg
    runner.close()


STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 24
OTHER = "An unrelated question about the weather in a small mountain village. " * 12
FOLLOW = STORY + "One stormy night a ship came too close to the rocks. What did the keeper do?"


def greedy(sched: Scheduler, runner, events: list, rid: str, text: str | list[int], cache: bool = True):
    """One greedy request (a text, or token ids) run to its end: its tokens, its logprobs, and
    its cached prompt tokens."""
    events.clear()
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=True, top_logprobs=5)
    ids = runner.tokenize(text, True) if isinstance(text, str) else list(text)
    sched.submit(Request(id=rid, params=params, prompt="x", cache_prompt=cache), ids)
    while sched.has_work():
        sched.step()
    deltas = [e for e in events if isinstance(e, Delta)]
    done = [e for e in events if isinstance(e, Done)][0]
    return ([t for d in deltas for t in d.token_ids],
            [(x.token, x.logprob, x.top) for d in deltas for x in d.logprobs], done.usage.cached_tokens)


def test_restored_from_ram_is_exactly_the_cold_answer(real):
    runner, cfg = real
    events = []
    sched = Scheduler(runner, cfg, events.append)
    greedy(sched, runner, events, "a", STORY)
    greedy(sched, runner, events, "b", OTHER)
    warm = greedy(sched, runner, events, "c", FOLLOW)
    cold = greedy(sched, runner, events, "d", FOLLOW, cache=False)
    assert warm[2] >= 256 and sched.cache.ram.hits >= 1 and cold[2] == 0
    assert warm[0] == cold[0] and warm[1] == cold[1]


# -- the disk tier ------------------------------------------------------------------------------

from appliance.engine.cache.disk import DiskTier  # noqa: E402


def test_disk_round_trip_and_restart(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=10_000, block=4, fingerprint="model-a")
    disk.put(list(range(12)), b"state-bytes" * 10)
    assert not list(tmp_path.glob("*.tmp"))
    again = DiskTier(tmp_path, max_bytes=10_000, block=4, fingerprint="model-a")  # a restart
    n, tokens, blob, exact = again.lookup(list(range(8)) + [99, 98])
    assert n == 8 and blob == b"state-bytes" * 10 and tokens == tuple(range(12)) and exact == 12
    disk.put(list(range(9)), b"nine" * 10, exact=4)    # an off-block length, 4 exact (fast mode)
    n, tokens, blob, exact = DiskTier(tmp_path, max_bytes=10_000, block=4, fingerprint="model-a").lookup(
        list(range(9)) + [1])
    assert (n, tokens, blob, exact) == (9, tuple(range(9)), b"nine" * 10, 4)


def test_stale_and_truncated_files_are_deleted_never_loaded(tmp_path, caplog):
    DiskTier(tmp_path, 10_000, "model-a", 4).put(list(range(8)), b"x" * 100)
    DiskTier(tmp_path, 10_000, "model-a", 4).put(list(range(100, 108)), b"y" * 100)
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 2
    files[0].write_bytes(files[0].read_bytes()[:-10])  # truncated by a crash
    with caplog.at_level("INFO", logger="appliance.prefix_cache"):
        other = DiskTier(tmp_path, 10_000, "model-b", 4)  # another model: both are stale
    assert other.files == {} and not list(tmp_path.glob("*.kv"))
    assert "stale fingerprint" in caplog.text or "incomplete" in caplog.text


def test_corrupt_blob_is_ignored_with_a_warning(tmp_path, caplog):
    DiskTier(tmp_path, 10_000, "m", 4).put(list(range(8)), b"z" * 100)
    path = next(tmp_path.glob("*.kv"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same length, wrong content
    path.write_bytes(bytes(data))
    disk = DiskTier(tmp_path, 10_000, "m", 4)
    with caplog.at_level("WARNING", logger="appliance.prefix_cache"):
        assert disk.lookup(list(range(8)) + [1]) == (0, (), None, 0)
    assert "checksum" in caplog.text and not path.exists()


def test_unwritable_directory_turns_the_tier_off_without_failing(tmp_path, caplog):
    target = tmp_path / "not-a-dir"
    target.write_text("a file where the directory should be")
    with caplog.at_level("WARNING", logger="appliance.prefix_cache"):
        disk = DiskTier(target / "cache", 10_000, "m", 4)
        disk.put(list(range(8)), b"x" * 10)
    assert not disk.enabled and disk.lookup(list(range(8))) == (0, (), None, 0)
    assert "disk tier off" in caplog.text


def test_byte_bound_evicts_the_least_valuable_file_the_oldest_of_equals(tmp_path):
    import os
    import time

    disk = DiskTier(tmp_path, max_bytes=800, block=4, fingerprint="m")  # ~376 bytes a file
    disk.put([1] * 4, b"a" * 200)
    old = next(tmp_path.glob("*.kv"))
    os.utime(old, (time.time() - 100, time.time() - 100))
    disk.put([2] * 4, b"b" * 200)
    disk.put([3] * 4, b"c" * 200)
    assert disk.bytes <= 800 and not old.exists() and disk.lookup([2] * 4)[0] == 4


# -- eviction by value ---------------------------------------------------------------------------

from appliance.engine.cache.cost import PrefillCost  # noqa: E402


def test_prefill_cost_learns_rates_by_depth_and_extrapolates():
    cost = PrefillCost()
    cost.observe(0, 512, 512.0)      # 1 ms a token near the start
    cost.observe(4096, 512, 3072.0)  # 6 ms a token past 4k
    assert cost.rate(0) == 1.0 and cost.rate(4) == 6.0
    assert cost.rate(8) > cost.rate(4)  # deeper than measured: grows with depth
    assert cost.cost_ms(2048) > 2 * cost.cost_ms(1024)  # recomputing deep tokens costs more


def test_a_long_conversation_survives_many_short_ones():
    cost = PrefillCost()
    for start in range(0, 8192, 512):  # per-token prefill cost rising with depth, as measured
        cost.observe(start, 512, 512 * (1 + start / 1024))
    per_token = 24_000  # bytes of KV per token, about SmolLM2's
    ram = RamTier(max_bytes=8192 * per_token + 20 * 256 * per_token, block=256, cost=cost)
    long_conv = [7] * 8192
    ram.put(long_conv, b"L" * (8192 * per_token))
    for i in range(40):  # forty short conversations arrive after it
        ram.put([1000 + i] * 256, b"s" * (256 * per_token))
    assert ram.lookup(long_conv + [1, 2, 3])[0] == 8192, "the long conversation's next turn still hits"
    assert len(ram.entries) == 21 and ram.bytes <= ram.max_bytes


def test_plain_lru_would_have_evicted_it():
    # the same arrivals with every token equally cheap: value per byte is flat, recency decides
    cost = PrefillCost()
    cost.observe(0, 512, 512.0)
    cost.ms_per_token = {b: 1.0 for b in range(64)}
    per_token = 24_000
    ram = RamTier(max_bytes=8192 * per_token + 20 * 256 * per_token, block=256, cost=cost)
    ram.put([7] * 8192, b"L" * (8192 * per_token))
    for i in range(40):
        ram.put([1000 + i] * 256, b"s" * (256 * per_token))
    assert ram.lookup([7] * 8192)[0] == 0


def test_disk_eviction_by_value_keeps_a_long_conversation(tmp_path):
    cost = PrefillCost()
    for start in range(0, 8192, 512):
        cost.observe(start, 512, 512 * (1 + start / 1024))
    per_token = 100  # small blobs: the shape matters, not the size
    disk = DiskTier(tmp_path, max_bytes=8192 * per_token + 20 * 256 * per_token + 40 * 400, block=256,
                    fingerprint="m", cost=cost)
    long_conv = [7] * 8192
    disk.put(long_conv, b"L" * (8192 * per_token))
    for i in range(40):
        disk.put([1000 + i] * 256, b"s" * (256 * per_token))
    assert disk.lookup(long_conv + [1])[0] == 8192 and disk.bytes <= disk.max_bytes


# -- pinning ---------------------------------------------------------------------------------------

def flat_cost() -> PrefillCost:
    cost = PrefillCost()
    cost.ms_per_token = {b: 1.0 for b in range(64)}
    return cost


def test_a_pinned_prefix_is_never_evicted_by_value():
    per_token = 24_000
    ram = RamTier(max_bytes=8192 * per_token + 20 * 256 * per_token, block=256, cost=flat_cost())
    ram.put([7] * 2048, b"L" * (2048 * per_token), pin=True)   # the same arrivals that evict it unpinned
    for i in range(60):
        ram.put([1000 + i] * 256, b"s" * (256 * per_token))
    assert ram.lookup([7] * 2048 + [1])[0] == 2048
    assert ram.stats()["ram_pinned_bytes"] == 2048 * per_token and ram.bytes <= ram.max_bytes


def test_pins_hold_at_most_their_share_and_the_oldest_pin_gives_way():
    ram = RamTier(max_bytes=1000, block=4, cost=flat_cost())
    ram.put([1] * 4, b"a" * 300, pin=True)
    ram.put([2] * 4, b"b" * 300, pin=True)     # 600 pinned > 500: the older pin becomes ordinary
    assert [e.pinned for e in ram.entries.values()] == [False, True]
    ram.put([3] * 4, b"c" * 600, pin=True)     # over the share on its own: kept, not pinned
    assert not ram.entries[state_key([3] * 4, block_chain([3] * 4, 4), 4)].pinned
    assert ram.lookup([2] * 4)[0] == 4 and ram.bytes <= 1000


def test_a_disk_pin_survives_a_restart_and_eviction(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=2000, block=4, fingerprint="m", cost=flat_cost())
    disk.put([1] * 4, b"p" * 300, pin=True)
    disk = DiskTier(tmp_path, max_bytes=2000, block=4, fingerprint="m", cost=flat_cost())   # a restart
    assert disk.pinned_bytes > 0
    for i in range(20):
        disk.put([100 + i] * 4, b"s" * 300)
    assert disk.lookup([1] * 4 + [9])[0] == 4 and disk.bytes <= 2000
    assert disk.stats()["disk_pinned_bytes"] == disk.pinned_bytes > 0
    (tmp_path / next(tmp_path.glob("*.pin")).name).with_suffix(".kv").unlink()
    DiskTier(tmp_path, max_bytes=2000, block=4, fingerprint="m")   # a pin without its state is removed
    assert not list(tmp_path.glob("*.pin"))


@pytest.mark.parametrize("pin, cached", [(True, 16), (False, 0)])
def test_a_pinned_request_stays_cached_through_a_flood(pin, cached):
    runner = FakeRunner(n_slots=1, n_ctx=256)
    # a RAM tier of 64 bytes: the fake runner's states are a byte or two a token
    cfg = EngineConfig(n_slots=1, n_ctx=256, prefill_chunk=4, step_token_budget=8, cache_ram_bytes=64)
    events = []
    sched = Scheduler(runner, cfg, events.append)
    # every token equally dear and nothing learned from wall time: recency alone decides, so
    # without the pin the system prompt is the first to go
    sched.cache.prefill_cost.ms_per_token = {b: 1.0 for b in range(4)}
    sched.cache.prefill_cost.observe = lambda *a: None

    def go(rid, prompt, pin=False):
        sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=2), prompt="x",
                             cache_pin=pin), prompt)
        while sched.has_work():
            sched.step()
        return [e for e in events if isinstance(e, Done) and e.request_id == rid][0]

    system = list(range(1, 17))
    go("sys", system + [99], pin=pin)
    assert (sched.cache.ram.stats()["ram_pinned_bytes"] > 0) == pin
    for i in range(30):                       # many other conversations pass through the one slot
        go(f"o{i}", [200 + i] * 9)
    assert go("turn", system + [42, 43]).usage.cached_tokens == cached


def test_idle_slots_are_written_behind_one_at_a_time(tmp_path):
    runner = FakeRunner(n_slots=2, n_ctx=256)
    cfg = EngineConfig(n_slots=2, n_ctx=256, prefill_chunk=4, step_token_budget=8)
    disk = DiskTier(tmp_path, max_bytes=1 << 20, block=4, fingerprint="fake")
    sched = Scheduler(runner, cfg, lambda e: None, PromptCache.from_config(runner, cfg, disk))
    for rid, prompt in (("a", list(range(1, 10))), ("b", list(range(50, 59)))):
        sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=2), prompt="x"), prompt)
    while sched.has_work():
        sched.step()
    assert sched.cache.persist_one() and len(disk.files) == 1
    assert sched.cache.persist_one() and len(disk.files) == 2
    assert not sched.cache.persist_one()            # nothing left: shutdown has nothing to write
    assert disk.lookup(list(range(1, 10)))[0] == 8 and disk.lookup(list(range(50, 59)))[0] == 8
