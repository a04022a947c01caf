"""Expert offload in the torch runner (runners/torch/experts.py): on a CPU both "devices" are
host memory, so what CI proves is correctness and policy. With a cache smaller than the expert
count, on the tiny qwen3moe and mixtral fixtures, every logit equals the all-resident runner's
bit for bit (several streams in one forward, prefill chunks, decode rows) in each compute mode;
through the whole engine, greedy replies are identical, the start-up exactness check still
passes (so speculation stays on), and timings, /health and /metrics carry the cache's figures.
The policy: frequency with decay keeps the hot experts of a synthetic trace that recency
evicts. The cost model: one row goes to the host, a long chunk to a copy."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from .runner_kinds import HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")

import torch  # noqa: E402
from prometheus_client.core import CollectorRegistry  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.loop import EngineLoop  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.runners.torch import experts  # noqa: E402
from web import wire  # noqa: E402
from web.metrics import EngineCollector  # noqa: E402

from .gguf_fixtures import write_tiny  # noqa: E402
from .runner_kinds import make_runner  # noqa: E402
from .test_speculate_identity import run  # noqa: E402  (submit together, step until done)

N_EXPERT, N_USED, N_LAYER = 8, 2, 2
SLOTS = 5                                  # of N_LAYER x N_EXPERT = 16 experts
IDS = [(i * 37) % 4000 + 5 for i in range(260)]


@pytest.fixture(scope="module", params=["qwen3moe", "mixtral", "gpt-oss"])
def moe(request, tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("moe") / f"{request.param}.gguf", request.param,
                      n_layer=N_LAYER, n_expert=N_EXPERT, n_expert_used=N_USED)
    resident = runner(path, "off")
    yield path, forwards(resident)
    resident.close()


def runner(path, cache: str, compute: str = "auto", dtype: str = "float32"):
    cfg = EngineConfig(engine="torch", n_slots=3, n_ctx=512, torch_dtype=dtype, expert_cache=cache,
                       expert_compute=compute)
    return make_runner("torch", cfg, path)


def forwards(r) -> list[np.ndarray]:
    """Prefill chunks of one stream, then two streams and a decode row in one forward, then
    decode steps of three streams together: every logit row, in order."""
    for s in range(3):
        r.truncate(s, 0)
    out = [r.forward([Span(0, tuple(IDS[i:i + 64]), i, len(IDS[i:i + 64]))])[0] for i in range(0, 192, 64)]
    out += r.forward([Span(1, tuple(IDS[:40]), 0, 40), Span(2, tuple(IDS[50:70]), 0, 20),
                      Span(0, (IDS[192],), 192, 1)])
    for step in range(6):
        out += r.forward([Span(0, (IDS[193 + step],), 193 + step, 1), Span(1, (IDS[40 + step],), 40 + step, 1),
                          Span(2, (IDS[70 + step],), 20 + step, 1)])
    return out


@pytest.mark.parametrize("compute", ["cpu", "device", "auto"])
def test_offloaded_logits_equal_all_resident_bit_for_bit(moe, compute):
    path, want = moe
    r = runner(path, str(SLOTS), compute)
    try:
        got = forwards(r)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"call {i}: max diff {np.abs(g - w).max()}"
        s = r.expert_stats()
        assert s.slots == SLOTS and s.experts == N_LAYER * N_EXPERT and s.resident == SLOTS
        assert 0 < s.hits < s.lookups            # the cache held some experts and lacked others
        assert s.lookups == sum(len(g) for g in got) * N_LAYER * N_USED
        if compute == "device":
            assert s.host_rows == 0 and s.copies > SLOTS
        else:                                    # misses computed where they lie
            assert s.host_rows > 0
        assert s.bytes_copied == s.copies * r.model.experts.expert_bytes
        lookups, hits = zip(*(r.expert_counts(slot) for slot in range(3)))
        assert sum(lookups) == s.lookups and sum(hits) == s.hits
    finally:
        r.close()


def test_bfloat16_offload_equals_bfloat16_resident(moe):
    path, _ = moe
    a, b = runner(path, "off", dtype="bfloat16"), runner(path, "3", "cpu", dtype="bfloat16")
    try:
        assert all(np.array_equal(x, y) for x, y in zip(forwards(a), forwards(b)))
    finally:
        a.close()
        b.close()


# -- through the engine ---------------------------------------------------------------------------

def chat(text: str, n: int = 12) -> object:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0,
            "cache_prompt": False}
    return wire.parse_chat(body, uuid.uuid4().hex, {"m"}, 512).request


PROMPTS = ["def main(): return main() " * 6, "The lighthouse keeper climbed the stairs", "1, 2, 3, 4, 5, 6, 7"]


def test_through_the_engine_greedy_replies_match_speculation_stays_on_and_figures_show(moe):
    path, _ = moe

    def loop(cache: str) -> EngineLoop:
        return EngineLoop(EngineConfig(model=str(path), engine="torch", n_ctx=512, n_slots=3, plan="off",
                                       cache_disk_bytes=0, torch_dtype="float32", expert_cache=cache))
    ref, off = loop("off"), loop(str(SLOTS))
    try:
        policy = off.scheduler.spec.policy
        assert policy.exactness is not None and policy.exactness.exact, policy.exactness
        assert policy.allowed and policy.default == "lookup"
        assert off.info.settings["expert_cache"] == SLOTS and "5 of 16" in off.info.settings["expert_plan"]
        assert ref.info.settings["expert_cache"] == "off"
        want = [t for t, _ in run(ref, [chat(p) for p in PROMPTS])]
        together = run(off, [chat(p) for p in PROMPTS])
        assert [t for t, _ in together] == want
        alone = [run(off, [chat(p)])[0] for p in PROMPTS]
        assert [t for t, _ in alone] == want
        rates = [d.timings.expert_hit_rate for _, d in together + alone]
        assert all(r is not None and 0.0 <= r <= 1.0 for r in rates) and max(rates) > 0
        assert "expert_hit_rate" in together[0][1].timings.as_dict()
        assert "expert_hit_rate" not in run(ref, [chat(PROMPTS[0])])[0][1].timings.as_dict()

        stats = off.stats()
        flat = stats.as_dict()
        assert flat["expert_slots"] == SLOTS and flat["expert_lookups"] > flat["expert_hits"] > 0
        assert "expert_slots" not in ref.stats().as_dict()
        registry = CollectorRegistry()
        registry.register(EngineCollector(lambda: stats, lambda: None))
        got = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
        assert got["appliance_expert_cache_slots"] == SLOTS
        assert got["appliance_expert_cache_hits_total"] == stats.experts.hits
        assert got["appliance_expert_cache_misses_total"] == stats.experts.lookups - stats.experts.hits
        assert got["appliance_expert_cache_copied_bytes_total"] == stats.experts.bytes_copied
        assert got["appliance_expert_host_rows_total"] == stats.experts.host_rows
    finally:
        ref.runner.close()
        off.runner.close()


# -- policy and cost model, on a synthetic layer ---------------------------------------------------

D, FF = 8, 16


def synthetic(n_expert: int, slots: int, compute: str, policy: str, costs=None) -> experts.ExpertCache:
    g = torch.Generator().manual_seed(0)
    host = [(torch.randn(n_expert, FF, D, generator=g), torch.randn(n_expert, FF, D, generator=g),
             torch.randn(n_expert, D, FF, generator=g))]
    costs = costs or experts.ExpertCosts(copy_s=1e-3, host=(1e-4, 1e-6), device=(1e-5, 1e-8))
    return experts.ExpertCache(host, slots, torch.device("cpu"), compute, policy, costs)


def call(cache: experts.ExpertCache, expert: int, rows: int = 1) -> torch.Tensor:
    x = torch.randn(rows, D)
    return cache.layer(0, x, torch.full((rows, 1), expert), torch.ones(rows, 1))


def trace(cycles: int = 100) -> list[int]:
    """Two hot experts, each used every fourth call, between them a scan of experts used once."""
    out, cold = [], 2
    for _ in range(cycles):
        out += [0, 1, cold, cold + 1]
        cold = cold + 2 if cold + 3 < 64 else 2
    return out


@pytest.mark.parametrize("compute", ["device", "cpu"])
def test_frequency_with_decay_keeps_the_hot_experts_recency_evicts(compute):
    rates = {}
    for policy in ("frequency", "recency"):
        cache = synthetic(64, 3, compute, policy)
        for e in trace():
            call(cache, e)
        s = cache.stats()
        rates[policy] = s.hits / s.lookups
    # frequency: the two hot experts stay and hit on every use after warm-up (half the calls);
    # recency: each scan pushes out the hot expert used longest ago, just before it returns
    assert rates["frequency"] > 0.45, rates
    assert rates["recency"] < 0.05, rates


def test_the_cost_model_sends_one_row_to_the_host_and_a_long_chunk_to_a_copy():
    costs = experts.ExpertCosts(copy_s=1e-3, host=(1e-4, 2e-5), device=(1e-5, 1e-7))
    assert costs.choose(1) == "host" and costs.choose(8) == "host"
    assert costs.choose(512) == "copy"
    cache = synthetic(8, 2, "auto", "frequency", costs)
    cache.promote = 0                           # the choice alone, no promotion after the call
    call(cache, 3, rows=1)
    assert cache.stats().host_rows == 1 and cache.stats().copies == 0
    call(cache, 4, rows=300)
    s = cache.stats()
    assert s.host_rows == 1 and s.copies == 1 and cache.slot_of[0, 4] >= 0


def test_results_do_not_depend_on_where_the_expert_ran():
    """The same rows through a slot and through the host copy: the same bits (CPU)."""
    a, b = synthetic(4, 4, "device", "frequency"), synthetic(4, 0, "cpu", "frequency")
    x = torch.randn(5, D)
    chosen = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]])
    w = torch.rand(5, 2)
    assert torch.equal(a.layer(0, x, chosen, w), b.layer(0, x, chosen, w))
    assert a.stats().copies == 4 and b.stats().host_rows == 10


def test_group_by_expert_sorts_rows_stably():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1]])
    rows, which, counts = experts.group_by_expert(chosen, 4)
    assert counts.tolist() == [2, 2, 2, 0]
    assert rows.tolist() == [0, 1, 1, 2, 0, 2] and which.tolist() == [1, 0, 1, 1, 0, 0]
