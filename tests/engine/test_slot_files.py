"""llama-server's slot save, restore and erase in the engine (cache/slot_files.py through
slot_commands.py): the file-name rule, what a slot keeps after each action, an action on a busy
slot waiting for its request, files that must never load; and on both real runners, a state
saved, erased and restored is reused and gives the same answer."""
from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.engine.cache.slot_files import valid_filename
from appliance.engine.ipc import GetSlots, SlotAction
from appliance.engine.sched.scheduler import Scheduler
from appliance.engine.slot_commands import SlotCommands
from appliance.engine.types import Delta, Done, Error, Request, SamplingParams, SlotDone
from appliance.errors import ApplianceError

from .fake_runner import FakeRunner
from .runner_kinds import KINDS, make_runner


@pytest.mark.parametrize("name,ok", [
    ("slot.bin", True), ("é-état.bin", True), (".hidden", True), ("x" * 255, True),
    ("", False), ("x" * 256, False), ("a/b", False), ("a\\b", False), ("..", False), (".", False),
    ("a..b", False), (" a", False), ("a ", False), ("a.", False), ("a:b", False), ("a*b", False),
    ('a"b', False), ("a<b", False), ("a|b", False), ("a\x00b", False), ("a\x7fb", False), ("a\x85b", False),
    ("a\ufeffb", False), ("a\u2215b", False), ("a\ufffdb", False), ("a\ud800b", False)])
def test_file_names_follow_llama_servers_rule(name, ok):
    assert valid_filename(name) is ok


def failed(request_id: str, e: Exception) -> Error:
    assert isinstance(e, ApplianceError), e
    return Error(request_id, *e.to_wire())


class Engine:
    """A scheduler over the fake runner with the loop's slot commands beside it."""

    def __init__(self, tmp_path, n_slots: int = 1, n_ctx: int = 256, save: bool = True) -> None:
        self.runner = FakeRunner(n_slots=n_slots, n_ctx=n_ctx)
        self.events: list = []
        cfg = EngineConfig(n_slots=n_slots, n_ctx=n_ctx, prefill_chunk=4, step_token_budget=8, cache_ram_bytes=0)
        self.sched = Scheduler(self.runner, cfg, self.events.append)
        self.cmds = SlotCommands(self.sched, str(tmp_path / "slots") if save else None, failed)

    def ask(self, rid: str, prompt: list[int], run: bool = True) -> Done | None:
        self.sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=3), prompt="x"), prompt)
        while run and self.sched.has_work():
            self.sched.step()
        return next((e for e in self.events if isinstance(e, Done) and e.request_id == rid), None)

    def act(self, action: str, filename: str = "", slot: int = 0):
        return self.cmds.act(SlotAction("s", slot, action, filename))


def test_save_erase_restore_then_the_prompt_is_reused(tmp_path):
    eng = Engine(tmp_path)
    prompt = list(range(1, 14))
    first = eng.ask("a", prompt)
    saved = eng.act("save", "conv.bin")
    assert isinstance(saved, SlotDone) and saved.n_tokens == 12 and saved.n_bytes > 0
    assert (tmp_path / "slots" / "conv.bin").is_file() and not list((tmp_path / "slots").glob("*:partial"))
    assert eng.act("erase").n_tokens == 12 and eng.sched.cache.kept[0] == [] and eng.runner.kv[0] == []
    assert eng.cmds.slots(GetSlots("g")).slots[0].n_prompt_tokens == 0
    restored = eng.act("restore", "conv.bin")
    assert restored.n_tokens == 12 and restored.n_bytes == saved.n_bytes
    assert eng.runner.kv[0] == prompt[:12] and eng.sched.cache.kept[0] == prompt[:12]
    again = eng.ask("b", prompt)
    assert again.usage.cached_tokens == 12 and again.token_ids == first.token_ids


def test_slots_view_shows_the_request_then_the_last_one(tmp_path):
    eng = Engine(tmp_path, n_slots=2)
    assert [s.id_task for s in eng.cmds.slots(GetSlots("g")).slots] == [None, None]
    eng.ask("a", list(range(1, 10)), run=False)
    eng.sched.step()
    busy = eng.cmds.slots(GetSlots("g")).slots
    assert busy[0].is_processing and busy[0].id_task == 1 and busy[0].params.max_tokens == 3
    assert busy[0].has_next_token and busy[0].n_prompt_tokens == busy[0].n_prompt_tokens_processed == 4  # one chunk
    while eng.sched.has_work():
        eng.sched.step()
    idle = eng.cmds.slots(GetSlots("g")).slots[0]
    assert not idle.is_processing and idle.id_task == 1 and idle.n_decoded == 3 and idle.n_remain == 0
    assert not idle.has_next_token and idle.n_prompt_tokens == len(eng.sched.cache.kept[0])


def test_an_action_on_a_busy_slot_waits_for_its_request(tmp_path):
    eng = Engine(tmp_path)
    eng.ask("a", list(range(1, 14)), run=False)
    eng.sched.step()                                  # the request holds the slot
    assert eng.act("save", "busy.bin") is None        # waits, as llama-server defers it
    assert eng.cmds.due() == [] and not (tmp_path / "slots" / "busy.bin").exists()
    while eng.sched.has_work():
        eng.sched.step()
    [done] = eng.cmds.due()
    assert isinstance(done, SlotDone) and done.n_tokens == 12 and (tmp_path / "slots" / "busy.bin").exists()


def test_refusals_touch_nothing(tmp_path):
    eng = Engine(tmp_path)
    prompt = list(range(1, 14))
    eng.ask("a", prompt)
    eng.act("save", "good.bin")
    other = Engine(tmp_path, n_ctx=512)               # another KV layout: its fingerprint differs
    other.ask("a", [5] * 9)
    path = tmp_path / "slots" / "good.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    (tmp_path / "slots" / "corrupt.bin").write_bytes(bytes(data))
    (tmp_path / "slots" / "short.bin").write_bytes(bytes(data[:-3]))
    (tmp_path / "slots" / "junk.bin").write_bytes(b"not a state")
    for engine, name, words in [(other, "good.bin", "another model or KV layout"), (eng, "corrupt.bin", "checksum"),
                                (eng, "short.bin", "not a saved slot state"), (eng, "junk.bin", "not a saved slot state"),
                                (eng, "missing.bin", "no file")]:
        kept = list(engine.sched.cache.kept[0])
        err = engine.act("restore", name)
        assert isinstance(err, Error) and err.kind == "InvalidRequest" and words in err.message, (name, err)
        assert engine.sched.cache.kept[0] == kept and engine.runner.kv[0][:len(kept)] == kept   # nothing half-applied
    assert "n_ctx=256" in other.act("restore", "good.bin").message
    for action, name, kind in [("save", "../x.bin", "InvalidRequest"), ("save", "a/b", "InvalidRequest"),
                               ("open", "x.bin", "InvalidRequest")]:
        err = eng.act(action, name)
        assert isinstance(err, Error) and err.kind == kind
    assert eng.act("erase", slot=3).message.startswith("Invalid slot ID")
    no_path = Engine(tmp_path, save=False)
    for action in ("save", "restore", "erase"):
        err = no_path.act(action, "x.bin")
        assert err.kind == "NotSupported" and "--slot-save-path" in err.message


# -- the real runners ------------------------------------------------------------------------------

STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 12


@pytest.mark.parametrize("kind", KINDS)
def test_real_runner_state_survives_save_erase_restore(tmp_path, kind):
    from appliance.models import embedded_model_path

    cfg = EngineConfig(n_slots=1, n_ctx=512, prefill_chunk=128)
    runner = make_runner(kind, cfg, embedded_model_path(), "smol")
    try:
        events: list = []
        sched = Scheduler(runner, cfg, events.append)
        cmds = SlotCommands(sched, str(tmp_path), failed)
        ids = runner.tokenize(STORY, True)

        def greedy(rid: str):
            events.clear()
            sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=8), prompt="x"), ids)
            while sched.has_work():
                sched.step()
            done = [e for e in events if isinstance(e, Done)][0]
            return [t for e in events if isinstance(e, Delta) for t in e.token_ids], done.usage.cached_tokens

        cold = greedy("a")
        saved = cmds.act(SlotAction("s", 0, "save", "story.bin"))
        assert saved.n_tokens >= 128
        cmds.act(SlotAction("e", 0, "erase"))
        restored = cmds.act(SlotAction("r", 0, "restore", "story.bin"))
        assert isinstance(restored, SlotDone) and restored.n_tokens == saved.n_tokens
        warm = greedy("b")
        assert warm[1] >= 128 and warm[0] == cold[0]
    finally:
        runner.close()
