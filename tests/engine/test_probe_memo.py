"""--probe-cache: a start-up probe's result is measured once and read back for the same runner,
settings and inputs, and measured again for anything else, or when its file is not what was
written. The probes themselves are tested against real runners elsewhere (test_speculate*,
test_grid_reuse); this is the memo around them."""
from __future__ import annotations

import dataclasses
import json

from appliance.engine.cache.invariance import ChunkInvariance
from appliance.engine.probe_memo import ProbeMemo
from appliance.engine.spec import CostModel, Exactness

from .fake_runner import FakeRunner


class Counting:
    """A probe that returns `result` and counts how often it really ran."""

    def __init__(self, result) -> None:
        self.result, self.runs = result, 0

    def __call__(self):
        self.runs += 1
        return self.result


def test_a_result_is_measured_once_and_read_back_equal(tmp_path):
    runner = FakeRunner()
    for name, result, kind in (("verify-exactness", Exactness(False, 0.629, 0, 9), Exactness),
                               ("verify-costs", CostModel((1, 2, 4), (1.0, 1.03, 1.38), 0.004), CostModel),
                               ("chunk-invariance", ChunkInvariance(17, 8, ("m=1: pieces",)), ChunkInvariance)):
        probe = Counting(result)
        first = ProbeMemo(str(tmp_path), runner)(name, {"k": 8}, probe, kind)
        again = ProbeMemo(str(tmp_path), FakeRunner())(name, {"k": 8}, probe, kind)   # a restart
        assert first == again == result and type(again) is kind and probe.runs == 1


def test_other_inputs_settings_or_versions_are_measured_again(tmp_path, monkeypatch):
    probe = Counting(Exactness(True, 0.0, 0, 9))
    memo = ProbeMemo(str(tmp_path), FakeRunner())
    memo("verify-exactness", {"k": 8}, probe, Exactness)
    memo("verify-exactness", {"k": 4}, probe, Exactness)                       # another input
    assert probe.runs == 2
    other = FakeRunner()
    other.info = dataclasses.replace(other.info, settings={"n_threads": 1})    # another setting
    ProbeMemo(str(tmp_path), other)("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 3
    ProbeMemo(str(tmp_path), FakeRunner(n_ctx=512))("verify-exactness", {"k": 8}, probe, Exactness)   # other KV
    assert probe.runs == 4
    monkeypatch.setattr("appliance.engine.probe_memo.__version__", "0.0.0-other")
    ProbeMemo(str(tmp_path), FakeRunner())("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 5


def test_a_file_that_is_not_what_was_written_is_measured_again(tmp_path):
    probe = Counting(Exactness(True, 0.0, 0, 9))
    ProbeMemo(str(tmp_path), FakeRunner())("verify-exactness", {"k": 8}, probe, Exactness)
    (path,) = tmp_path.glob("verify-exactness-*.json")
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**stored["key"], "cpu": "another CPU"}}))  # copied from elsewhere
    ProbeMemo(str(tmp_path), FakeRunner())("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 2
    path.write_text("{not json")
    got = ProbeMemo(str(tmp_path), FakeRunner())("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 3 and got == probe.result
    assert json.loads(path.read_text())["result"]["exact"] is True      # rewritten whole


def test_without_a_directory_every_start_measures(tmp_path):
    probe = Counting(Exactness(True, 0.0, 0, 9))
    for _ in range(3):
        ProbeMemo(None, FakeRunner())("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 3 and not list(tmp_path.iterdir())


def _placed(free: int, budget: int, n_gpu_layers: int) -> FakeRunner:
    runner = FakeRunner()
    runner.info = dataclasses.replace(runner.info, placement={
        "n_gpu_layers": n_gpu_layers, "gpu": "GPU0", "notes": [f"GPU0 has {budget} bytes"],
        "devices": {"GPU0": {"weights": {"attn": 10}, "kv": 4, "compute": 2, "total": 16, "budget": budget,
                             "headroom": budget - 16}},
        "llama_devices": [{"name": "Vulkan0", "kind": "gpu", "free": free, "total": 2**33}]})
    return runner


def test_free_memory_is_no_part_of_the_key_but_the_placement_is(tmp_path):
    """A restart sees other free memory (and so other budgets) every time: the same placement
    reads its result back; layers placed elsewhere measure again."""
    probe = Counting(Exactness(True, 0.0, 0, 9))
    ProbeMemo(str(tmp_path), _placed(2**32, 2**31, 31))("verify-exactness", {"k": 8}, probe, Exactness)
    ProbeMemo(str(tmp_path), _placed(2**32 - 4096, 2**31 - 4096, 31))("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 1
    ProbeMemo(str(tmp_path), _placed(2**32, 2**31, 15))("verify-exactness", {"k": 8}, probe, Exactness)
    assert probe.runs == 2
