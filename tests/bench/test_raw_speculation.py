"""The raw workers decode with the speculation `serve --speculate auto` would run on their runner
(issue 49: `tune --engines` compares the engines as each serves): prompt lookup drafts, chosen by
the server's own arithmetic, verified greedily; the tokens are the serial run's, and where the
start-up probe finds a verify inexact the run is serial, saying why."""
from __future__ import annotations

import pytest

from appliance.bench.raw import RawSettings, _Llama
from appliance.bench.raw_run import speculative_run, timed_run
from appliance.compute_settings import LlamaCppSettings
from appliance.engine.grid import Grid
from appliance.engine.spec import CostModel
from appliance.engine.spec.lookup import NgramIndex
from appliance.engine.spec.policy import Policy

from ..engine.gguf_fixtures import write_tiny_llama

N_GEN = 40
PROMPT = [int(t) for t in (list(range(20, 70)) * 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # heads of 32: q8_0 blocks fit
    return str(write_tiny_llama(tmp_path_factory.mktemp("spec") / "tiny.gguf", n_head=2, n_head_kv=1))


def settings(kv_type: str, n_slots: int = 2, engine: str = "llamacpp") -> RawSettings:
    return RawSettings(512, n_slots, LlamaCppSettings(n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512,
                                                     flash_attn=True), Grid(64, 0), kv_type=kv_type, engine=engine)


@pytest.fixture(scope="module")
def llama_q8(tiny):
    llama = _Llama(tiny, settings("q8_0"))
    yield llama
    llama.L.llama_batch_free(llama.batch)
    llama.L.llama_free(llama.ctx)
    llama.L.llama_model_free(llama.model)


@pytest.fixture(scope="module")
def torch_worker(tiny):
    pytest.importorskip("torch")
    from appliance.bench.raw_torch import TorchWorker

    w = TorchWorker(tiny, settings("f16", engine="torch"))
    yield w
    w.close()


ALWAYS = Policy(default="lookup", modes=("lookup",), reason="forced by the test",
                cost=CostModel((1, 16), (1.0, 1.0)))   # a verify as cheap as a step: every proposal is taken


def oracle(monkeypatch, prompts, serial):
    """Prompt lookup replaced by drafts that are the serial continuation with every third token
    wrong (a random model never repeats itself for lookup to find): accepts and rejections."""
    def propose(self, k):
        s = next(i for i, p in enumerate(prompts) if self.toks[:len(p)] == p and len(self.toks) - len(p) <= N_GEN)
        done = len(self.toks) - len(prompts[s])
        return tuple(t if (done + j) % 3 else t + 1 for j, t in enumerate(serial[s][done:done + k]))

    monkeypatch.setattr(NgramIndex, "propose", propose)


@pytest.mark.parametrize("worker", ["llama_q8", "torch_worker"])
def test_drafted_tokens_verified_greedily_are_the_serial_tokens(worker, request, monkeypatch):
    w = request.getfixturevalue(worker)
    prompts = [PROMPT, PROMPT[:130]]
    serial = timed_run(w, prompts, N_GEN)[3]
    oracle(monkeypatch, prompts, serial)
    w.spec_policy = ALWAYS
    try:
        *_, tokens, account = speculative_run(w, [PROMPT, PROMPT[:130]], N_GEN)
        assert tokens == serial
        assert account["mode"] == "lookup" and 0 < account["accepted"] < account["proposed"]
        # each forward commits its accepted drafts plus the target's own token, per stream
        *_, one, single = speculative_run(w, [PROMPT], N_GEN)
        assert one[0] == serial[0] and single["steps"] + single["accepted"] == N_GEN - 1
    finally:
        w.spec_policy = None


def test_the_start_up_probe_decides_as_the_server_does(torch_worker, llama_q8, tiny):
    """Unforced: the torch runner's verify is exact (it drafts when the costs say so); llama.cpp
    with f16 KV and flash attention has each answer with its reason."""
    *_, tokens, account = speculative_run(torch_worker, [PROMPT], 24)
    assert account["reason"] == "the runner verifies k tokens exactly as k steps"
    assert tokens == timed_run(torch_worker, [PROMPT], 24)[3]
    f16 = _Llama(tiny, settings("f16", n_slots=1))
    try:
        *_, tokens, account = speculative_run(f16, [PROMPT], 24)
        assert tokens == timed_run(f16, [PROMPT], 24)[3]
        exact = account["reason"] == "the runner verifies k tokens exactly as k steps"
        assert account["mode"] == ("lookup" if exact else "off")
        assert exact or ("verify differs from one-token steps" in account["reason"] and account["proposed"] == 0)
    finally:
        f16.L.llama_batch_free(f16.batch)
        f16.L.llama_free(f16.ctx)
        f16.L.llama_model_free(f16.model)
