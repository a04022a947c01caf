"""LoRA adapters on the llama.cpp runner: a tiny adapter for a tiny model, checked against
llama-cpp-python's own application of it (its `Llama(lora_path=...)`, outside the appliance)."""
from __future__ import annotations

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine.lora import resolve
from appliance.engine.runners.base import Span
from appliance.engine.types import LoraAdapter
from appliance.errors import InvalidRequest

from .gguf_fixtures import write_tiny
from .lora_fixture import write_tiny_lora

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = write_tiny(d / "base.gguf", "llama")
    return base, write_tiny_lora(d / "a.gguf", base, seed=1), write_tiny_lora(d / "b.gguf", base, seed=2, rank=2)


def _runner(base, **lora):
    from appliance.engine.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(EngineConfig(model=str(base), n_slots=2, n_ctx=256, n_threads=1, **lora), base, "tiny")


@pytest.fixture(scope="module")
def runner(files):
    base, a, b = files
    r = _runner(base, lora=str(a), lora_scaled=f"{b}:0.5")
    yield r
    r.close()


@pytest.fixture(scope="module")
def plain(files):
    """The same model and settings without --lora."""
    r = _runner(files[0])
    yield r
    r.close()


def logits(r, ids, lora=(), slot=0) -> np.ndarray:
    r.truncate(slot, 0)
    return r.forward([Span(slot, tuple(ids), 0, 1, lora)])[0][-1]


def reference(base, ids, threads, lora_path=None, scale=1.0) -> np.ndarray:
    """llama-cpp-python's high-level Llama, with the adapter as it applies one (its context's
    settings are its own: the same logits to within float rounding, not bit for bit)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(base), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=True,
                lora_path=None if lora_path is None else str(lora_path), lora_scale=scale)
    try:
        llm.eval(ids)
        return np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    finally:
        llm.close()


def test_adapters_are_listed_with_their_start_scales(runner, files):
    _, a, b = files
    assert runner.info.adapters == (LoraAdapter(0, str(a), 1.0), LoraAdapter(1, str(b), 0.5))
    assert runner.info.settings["lora"] == [f"{a}:1", f"{b}:0.5"]


def test_scale_zero_is_the_base_model_bit_for_bit(runner, plain):
    ids = runner.tokenize(PROMPT, True)
    want = logits(plain, ids)
    assert np.array_equal(logits(runner, ids, resolve([(0, 0.0), (1, 0.0)], runner.info.adapters)), want)
    logits(runner, ids, ((0, 1.0),))
    assert np.array_equal(logits(runner, ids), want)   # and the empty set after a set was applied


def test_scale_one_is_llama_cpps_own_application(runner, files):
    ids = runner.tokenize(PROMPT, True)
    got, base = logits(runner, ids, ((0, 1.0),)), logits(runner, ids)
    assert np.abs(got - base).max() > 1.0 and int(got.argmax()) != int(base.argmax())
    threads = runner.llamacpp.n_threads
    assert np.allclose(base, reference(files[0], ids, threads), atol=1e-4)
    assert np.allclose(got, reference(files[0], ids, threads, files[1], 1.0), atol=1e-4)


def test_a_set_changes_between_forwards_and_leaks_into_none(runner):
    ids = runner.tokenize(PROMPT, True)
    base = logits(runner, ids)
    both = logits(runner, ids, ((0, 1.0), (1, 0.5)))
    assert not np.array_equal(both, logits(runner, ids, ((0, 1.0),)))
    assert np.array_equal(logits(runner, ids), base)
    assert np.array_equal(logits(runner, ids, ((0, 1.0), (1, 0.5)), slot=1), both)


def test_one_forward_refuses_two_sets(runner):
    from appliance.errors import EngineFailure

    with pytest.raises(EngineFailure):
        runner.forward([Span(0, (1, 2), 0, 1, ()), Span(1, (1, 2), 0, 1, ((0, 1.0),))])


def test_resolve():
    ads = (LoraAdapter(0, "a", 1.0), LoraAdapter(1, "b", 0.0))
    assert resolve(None, ads) == ((0, 1.0),)
    assert resolve([(1, 0.25)], ads) == ((1, 0.25),)      # not listed: 0 (llama-server's rule)
    assert resolve([], ads) == ()
    with pytest.raises(InvalidRequest) as e:
        resolve([(0, 1.0), (2, 1.0)], ads)
    assert e.value.param == "lora[1].id"
    with pytest.raises(InvalidRequest) as e:
        resolve([(0, float("nan"))], ads)
    assert e.value.param == "lora[0].scale"


def test_a_file_that_is_no_adapter_fails_the_start(files, tmp_path):
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from appliance.errors import ModelLoadError

    base = files[0]
    with pytest.raises(ModelLoadError, match="--lora"):
        LlamaCppRunner(EngineConfig(model=str(base), n_ctx=256, lora=str(base)), base, "tiny")


def test_torch_refuses_lora_at_start(files):
    with pytest.raises(ValueError, match="--lora needs the llama.cpp engine"):
        EngineConfig(engine="torch", lora=str(files[1]))


# -- the scheduler: one adapter set a step, the prompt cache keyed on the set ----------------------

from appliance.engine.sched.scheduler import Scheduler  # noqa: E402
from appliance.engine.types import Delta, Done, Request, SamplingParams  # noqa: E402

STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 6
A = ((0, 1.0),)


def run(sched, reqs: dict[str, tuple[list[int], object]], cache: bool = True) -> dict[str, tuple[list[int], int]]:
    """Greedy requests submitted together, run to their ends: each one's tokens and cached count."""
    events: list = []
    sched.emit = events.append
    for rid, (ids, lora) in reqs.items():
        sched.submit(Request(id=rid, params=SamplingParams(temperature=0, max_tokens=12), prompt="x",
                             cache_prompt=cache, lora=lora), ids)
    while sched.has_work():
        sched.step()
    done = {e.request_id: e for e in events if isinstance(e, Done)}
    assert set(done) == set(reqs), [e for e in events if not isinstance(e, (Delta, Done))]
    return {rid: ([t for e in events if isinstance(e, Delta) and e.request_id == rid for t in e.token_ids],
                  done[rid].usage.cached_tokens) for rid in reqs}


@pytest.fixture
def sched(runner):
    for slot in range(runner.info.n_slots):
        runner.truncate(slot, 0)
    return Scheduler(runner, EngineConfig(n_slots=2, n_ctx=256, prefill_chunk=32), lambda e: None)


def test_request_scales_change_the_reply_and_do_not_leak(sched, runner):
    ids = runner.tokenize(STORY, True)
    base = run(sched, {"a": (ids, ())}, cache=False)["a"][0]
    under = run(sched, {"b": (ids, A)}, cache=False)["b"][0]
    assert under != base
    assert run(sched, {"c": (ids, ())}, cache=False)["c"][0] == base
    assert run(sched, {"d": (ids, None)}, cache=False)["d"][0] != base   # None: the start scales (1 and 0.5)


def test_requests_under_different_sets_run_together_as_each_alone(sched, runner):
    ids = runner.tokenize(STORY, True)
    alone = {rid: run(sched, {rid: (ids, lora)}, cache=False)[rid][0] for rid, lora in (("a", ()), ("b", A))}
    together = run(sched, {"a": (ids, ()), "b": (ids, A)}, cache=False)
    assert {rid: got[0] for rid, got in together.items()} == alone


def test_the_prompt_cache_never_reuses_a_prefix_across_sets(sched, runner):
    ids = runner.tokenize(STORY, True)
    cold = run(sched, {"cold": (ids, A)}, cache=False)["cold"][0]
    sched = Scheduler(runner, sched.cfg, lambda e: None)   # a cache that holds nothing yet
    assert run(sched, {"base": (ids, ())})["base"][1] == 0
    first = run(sched, {"a": (ids, A)})["a"]
    assert first == (cold, 0)                      # the base model's KV was there: not reused
    again = run(sched, {"b": (ids, A)})["b"]
    assert again[0] == cold and again[1] > 0       # its own set's KV is
    assert sched.cache.kept_lora == [(), A] or sched.cache.kept_lora == [A, ()]
    assert not (sched.cache.ram and sched.cache.ram.entries)   # states under adapters stay in their slots
