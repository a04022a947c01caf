"""The draft model on the real embedded model, through the whole engine: on every runner that
proves itself exact, drafts from a draft model give serial greedy decoding's tokens exactly,
on the shipped bench prompt sets and on generated prompts, alone and with several streams,
with the prompt cache on and off. Two pairs, one per exact runner:
- torch serving, drafted by the same model on llama.cpp (their argmaxes agree on ~95% of
  positions, so long drafts are accepted: the accept path);
- llama.cpp with a q8_0 KV (flash attention's 8-bit kernel), drafted by a tiny random model
  that shares the tokenizer (nearly every draft is wrong at its first token: the cut path).
Both draft on every step, as if drafting and verifying were free, so that identity is tested
whatever the adaptive rule would decide.

Never loosen these comparisons: a verify that lets a wrong draft token through is the bug."""
from __future__ import annotations

import dataclasses
import os

import pytest

from appliance.config import EngineConfig
from appliance.engine import spec as speculate
from appliance.engine.loop import EngineLoop

from .gguf_fixtures import write_tiny
from .runner_kinds import needs_torch
from .test_speculate_identity import N_CTX, chat, equals_serial_on_shipped_sets, generated, run, serial

# Every shipped set but long-document is covered by one pair or the other, within CI time:
# torch, the first prompt of each set but tool-calls (llama.cpp drafting for it prefills at a
# third of torch's rate); llama.cpp with a q8_0 KV, whose tiny draft model prefills fast,
# tool-calls and three short ones. long-document (~5,000 tokens: ~30 s of CI) adds depth
# only: past 256 keys llama.cpp's flash attention takes one path at any depth, and
# tool-calls (~900 tokens, two prefill chunks) crosses it; lookup speculation runs over it on
# torch (test_speculate_identity.py). Torch ran every prompt of prose, code, repetitive and
# multilingual too (25 prompts, ~5 min on a 2-core AVX2 CPU, where it computes in float32):
# more of the same accept path on more text. One prompt a set still has the draft model draft
# over a hundred tokens, more than half of them accepted, and a run reuse a cached prefix (all
# asserted).
PAIRS = {
    "torch+llamacpp-draft": ({"engine": "torch", "draft_model": "embedded", "draft_engine": "llamacpp"},
                             {"prose": 1, "code": 1, "editing-code": 1, "tool-calls": 0,
                              "repetitive": 1, "multilingual": 1, "long-document": 0}, 3),
    "llamacpp-q8kv+tiny-draft": ({"engine": "llamacpp", "kv_type": "q8_0", "draft_engine": "llamacpp"},
                                 {"prose": 1, "code": 1, "editing-code": 0, "tool-calls": 1,
                                  "repetitive": 0, "multilingual": 1, "long-document": 0}, 2),
}


@pytest.fixture(scope="module", params=[pytest.param("torch+llamacpp-draft", marks=needs_torch),
                                        "llamacpp-q8kv+tiny-draft"])
def pair(request, tmp_path_factory):
    cfg, per_set, streams = PAIRS[request.param]
    if "draft_model" not in cfg:
        # heads of 32: the draft's KV is q8_0 too, whose blocks of 32 must divide a head; trained
        # at the served context, which the draft model is served at
        tiny = write_tiny(tmp_path_factory.mktemp("draft") / "tiny.gguf", "llama", n_head=2, n_head_kv=1, n_ctx=N_CTX)
        cfg = {**cfg, "draft_model": str(tiny)}
    # its start-up probes remembered across modules, as engine() in test_speculate_identity.py
    loop = EngineLoop(EngineConfig(n_ctx=N_CTX, n_slots=4, plan="off", cache_disk_bytes=0,
                                   probe_cache=os.environ.get("APPLIANCE_PROBE_CACHE"), **cfg))
    free = speculate.CostModel((1, 16), (1.0, 1.0))
    # a prior of at least one half: the random draft model measured ~0 and would never draft
    draft = dataclasses.replace(loop.scheduler.spec.drafter.cost, unit=0.0, prior=max(0.5, loop.scheduler.spec.drafter.cost.prior))
    # drafts of at most 6: every step drafts, and 15 draft forwards a step would cost CI minutes
    loop.measured = loop.scheduler.spec.policy  # what start-up decided, before the test's overrides
    loop.scheduler.spec.policy = dataclasses.replace(loop.measured, cost=free, draft=draft, k_max=6)
    loop.scheduler.spec.drafter.cost = draft
    loop.scheduler.spec.drafter.observe = lambda *a: None  # keep drafting free
    propose, loop.drafted = loop.scheduler.spec.drafter.propose, []  # what the draft model itself proposed

    def counted(asks):
        got = propose(asks)
        loop.drafted.extend(got)
        return got
    loop.scheduler.spec.drafter.propose = counted
    yield request.param, loop, per_set, streams
    loop.close()


def test_the_draft_model_is_checked_measured_and_the_default(pair):
    name, loop, *_ = pair
    p = loop.measured
    assert p.exactness.exact and p.default == "draft" and p.modes == ("lookup", "draft")
    assert p.draft is not None and p.draft.unit > 0 and p.draft.cost.rows[0] == 1
    info = loop.info.settings["speculation"]["draft_model"]
    assert info["backend"] == "llama.cpp"
    if name.startswith("torch"):  # the same weights: their argmaxes nearly always agree
        assert p.draft.prior > 0.8
    else:                         # random weights: they nearly never do
        assert p.draft.prior < 0.2


def test_draft_equals_serial_on_the_shipped_prompt_sets(pair):
    name, loop, per_set, _ = pair
    cached = equals_serial_on_shipped_sets(loop, per_set, "draft")
    assert all(c[1].timings.draft_n > 0 for c in cached)
    accepted = sum(c[1].timings.draft_n_accepted for c in cached)
    drafted = sum(c[1].timings.draft_n for c in cached)
    assert sum(len(d) for d in loop.drafted) > 100  # the draft model drafted (prompt lookup also may)
    if name.startswith("torch"):
        assert accepted > drafted / 2


def test_draft_equals_serial_on_generated_prompts(pair):
    _, loop, *_ = pair
    for text in generated(3, seed=1):
        msgs = [{"role": "user", "content": text}]
        (drafted,) = run(loop, [chat(msgs, mode="draft", cache=False)])
        assert drafted[0] == serial(loop, msgs)[0]


def test_several_streams_drafted_together_equal_each_alone(pair):
    _, loop, _, streams = pair
    cases = [[{"role": "user", "content": text}] for text in generated(streams, seed=2)]
    alone = [serial(loop, m)[0] for m in cases]
    together = run(loop, [chat(m, mode="draft", cache=False) for m in cases])
    assert [t for t, _ in together] == alone
    assert all(d.timings.draft_n > 0 for _, d in together)
    assert loop.scheduler.stats().max_decode_batch >= 2
