"""MTP speculation: the served model's own next-n head drafts through llama.cpp's MTP context
and the scheduler's verify/accept path takes the drafts (issue 48).

On a tiny glm4moe GGUF written at test time (gguf_mtp_fixture.py: random Q4_1 weights, one
next-n block, a head that agrees with the trunk often enough to have drafts both accepted and
cut), served by llama.cpp with a q8_0 KV, where the start-up check proves a verify exact:
llama.cpp loads the block and creates the MTP context; output with MTP drafting equals output
without, token for token, greedy and seeded, one stream and several, cache on and off; the
head's measured agreement is the acceptance it shows; a model without next-n layers refuses
`--speculate mtp` and a request's "mtp" with the reason.

Every case drafts on every step, as if drafting and verifying were free (the adaptive rule
would rarely draft with a head this weak and this dear against a 2-block trunk): identity must
hold whatever the rule decides. Never loosen these comparisons."""
from __future__ import annotations

import dataclasses
import uuid

import pytest

from appliance.config import EngineConfig
from appliance.engine import spec as speculate
from appliance.engine.loop import EngineLoop
from appliance.engine.runners import llamacpp_mtp
from appliance.engine.types import Error
from appliance.errors import ModelLoadError
from web import wire

from .gguf_mtp_fixture import MTP_ARCH, MtpDims, write_split_mtp, write_tiny_mtp
from .test_speculate_identity import run

N_CTX, N_GEN = 1024, 40
PROMPTS = ("Hello there, how are you", "Write a poem about the sea",
           "List three colours, then explain why the sky looks blue on a clear day.")


def engine(path, speculate_mode: str = "auto", **kw) -> EngineLoop:
    kw.setdefault("kv_type", "q8_0")
    return EngineLoop(EngineConfig(engine="llamacpp", model=str(path), n_ctx=N_CTX, n_slots=3, plan="off",
                                   cache_disk_bytes=0, speculate=speculate_mode, **kw))


def chat(text: str, mode: str, temperature: float = 0.0, seed: int | None = None, cache: bool = True):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": N_GEN,
            "temperature": temperature, "speculate": mode, "cache_prompt": cache}
    if seed is not None:
        body["seed"] = seed
    return wire.parse_chat(body, uuid.uuid4().hex, {"m"}, N_CTX).request


def drafting_free(loop: EngineLoop) -> EngineLoop:
    """The engine with drafting and verifying priced as free, so that every step drafts up to 6
    tokens; `measured` keeps what start-up decided. (scripts/fixed_shape_ab.py uses it too: an
    identity on accepted drafts, not on a policy that declined to draft; lookup has no drafter.)"""
    sp = loop.scheduler.spec
    loop.measured = sp.policy
    sp.policy = dataclasses.replace(sp.policy, cost=speculate.CostModel((1, 16), (1.0, 1.0)),
                                    k_max=min(6, sp.policy.k_max))   # a fixed shape's rows less one
    if sp.drafter is not None:
        free = dataclasses.replace(sp.drafter.cost, unit=0.0)
        sp.policy = dataclasses.replace(sp.policy, draft=free)
        sp.drafter.cost = free
        sp.drafter.observe = lambda *a: None   # keep drafting free
    return loop


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf"
    write_tiny_mtp(path, agree=True)
    loop = drafting_free(engine(path))
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def mtp_fixed(tmp_path_factory):
    """The same model on llama.cpp's defaults (f16 KV, its default attention: a plain verify is
    not exact), every step and verify at a fixed shape of 5 rows (--fixed-shape on)."""
    path = tmp_path_factory.mktemp("mtp-fixed") / "tiny-mtp.gguf"
    write_tiny_mtp(path, agree=True)
    loop = drafting_free(engine(path, kv_type="f16", fixed_shape="on"))
    yield loop
    loop.close()


def test_mtp_at_a_fixed_shape_equals_serial(mtp_fixed):
    """Greedy and seeded, one stream, then three together: MTP drafts (at most 4 tokens, the
    shape's rows less one) give serial decoding's tokens, where the plain verify would not."""
    p = mtp_fixed.measured
    assert p.exactness.exact and p.default == "mtp" and p.k_max == 4
    shape = mtp_fixed.info.settings["speculation"]["decode_shape"]
    assert shape["mode"] == "fixed" and shape["rows"] == 5 and shape["exact"]
    on = []
    for text in PROMPTS:
        on += _same(mtp_fixed, [chat(text, "off", cache=False)], [chat(text, "mtp")])
    on += _same(mtp_fixed, [chat(PROMPTS[1], "off", 0.8, seed=3, cache=False)], [chat(PROMPTS[1], "mtp", 0.8, seed=3)])
    assert 0 < sum(d.timings.draft_n_accepted for _, d in on) < sum(d.timings.draft_n for _, d in on)
    reqs = [(PROMPTS[0], 0.0, None), (PROMPTS[1], 0.8, 7), (PROMPTS[2], 0.0, None)]
    alone = [run(mtp_fixed, [chat(t, "off", temp, seed, cache=False)])[0][0] for t, temp, seed in reqs]
    together = run(mtp_fixed, [chat(t, "mtp", temp, seed, cache=False) for t, temp, seed in reqs])
    assert [t for t, _ in together] == alone
    assert mtp_fixed.scheduler.stats().max_decode_batch >= 2


def test_llama_cpp_loads_the_next_n_block_and_mtp_is_the_default(mtp):
    import llama_cpp as L
    r = mtp.runner
    assert r.info.arch == MTP_ARCH and MTP_ARCH in llamacpp_mtp.MTP_ARCHS
    assert L.llama_model_n_layer_nextn(r.model) == 1 and r.nextn is not None and r.mtp_refusal is None
    p = mtp.measured
    assert p.exactness.exact and p.default == "mtp" and p.modes == ("lookup", "mtp")
    assert p.draft is not None and p.draft.unit > 0 and p.draft.cost.rows[0] == 1
    report = mtp.info.settings["speculation"]
    assert report["default"] == "mtp" and report["mtp_refusal"] is None
    assert report["mtp"] == {"arch": MTP_ARCH, "n_embd": 128, "source": "bundled"}


def _same(loop, reqs_off, reqs_mtp):
    off = run(loop, reqs_off)
    on = run(loop, reqs_mtp)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(d.timings.speculation == "mtp" for _, d in on)
    return on


def test_mtp_equals_serial_greedy(mtp):
    before = mtp.stats().spec
    on = []
    for text in PROMPTS:
        on += _same(mtp, [chat(text, "off", cache=False)], [chat(text, "mtp")])
    proposed = sum(d.timings.draft_n for _, d in on)
    accepted = sum(d.timings.draft_n_accepted for _, d in on)
    assert 0 < accepted < proposed          # drafts both accepted and cut
    assert any(d.timings.tokens_per_step > 1 for _, d in on)
    after = mtp.stats().spec                # /metrics' totals count them
    assert after.draft_accepted - before.draft_accepted == accepted
    assert after.draft_proposed - before.draft_proposed == proposed


def test_mtp_equals_serial_seeded(mtp):
    on = []
    for i, text in enumerate(PROMPTS[:2]):
        on += _same(mtp, [chat(text, "off", 0.8, seed=i, cache=False)], [chat(text, "mtp", 0.8, seed=i)])
    assert sum(d.timings.draft_n_accepted for _, d in on) > 0


def test_several_mtp_streams_equal_each_alone(mtp):
    """Three streams of other prompt lengths draft together, greedy and seeded, cache off."""
    reqs = [(PROMPTS[0], 0.0, None), (PROMPTS[1], 0.8, 7), (PROMPTS[2], 0.0, None)]
    alone = [run(mtp, [chat(t, "off", temp, seed, cache=False)])[0][0] for t, temp, seed in reqs]
    together = run(mtp, [chat(t, "mtp", temp, seed, cache=False) for t, temp, seed in reqs])
    assert [t for t, _ in together] == alone
    assert sum(d.timings.draft_n_accepted for _, d in together) > 0
    assert mtp.scheduler.stats().max_decode_batch >= 2


def test_a_cached_prefix_keeps_identity(mtp):
    """A prompt the cache already holds (the head's KV follows by token lists) and one that
    shares its start: both equal serial decoding."""
    text = PROMPTS[2] + " " + " ".join(f"Colour {i} is number {i * 7 % 13}." for i in range(40))  # past MIN_REUSE
    ref = run(mtp, [chat(text, "off", cache=False)])[0][0]
    run(mtp, [chat(text, "mtp")])
    (again, d), = run(mtp, [chat(text, "mtp")])
    assert again == ref and d.timings.cache_n > 0
    longer = text + " Answer in one sentence."
    ref2 = run(mtp, [chat(longer, "off", cache=False)])[0][0]
    assert run(mtp, [chat(longer, "mtp")])[0][0] == ref2


def test_a_server_with_the_head_answers_as_one_without(mtp):
    """The MTP server's replies, with drafting and without, equal those of a server that never
    loaded the head (the target keeps the trunk's hidden rows there; that must change no
    logit), on a prompt of two prefill chunks too."""
    long = PROMPTS[2] + " " + " ".join(f"Colour {i} is number {i * 7 % 13}." for i in range(60))
    texts = [PROMPTS[0], long]
    plain = engine(mtp.runner.info.model_path, "off")
    try:
        assert plain.runner.nextn is None
        ref = [run(plain, [chat(t, "off", cache=False)])[0][0] for t in texts]
    finally:
        plain.close()
    assert len(mtp.runner.tokenize(long, add_special=False)) > 512   # past the first chunk
    assert [run(mtp, [chat(t, "off", cache=False)])[0][0] for t in texts] == ref
    assert [run(mtp, [chat(t, "mtp")])[0][0] for t in texts] == ref


def test_acceptance_follows_the_heads_agreement(tmp_path):
    """The agreement measured at start (teacher-forced argmax of head against trunk) is what
    drafting shows: a random head agrees with its trunk on almost no token, and its first
    drafted tokens are almost never accepted; the agreeing head's are, at about its rate."""
    path = tmp_path / "random-head.gguf"
    write_tiny_mtp(path, agree=False, seed=1)
    loop = engine(path)
    try:
        prior = loop.scheduler.spec.policy.draft.prior
        assert prior < 0.05
        sp = loop.scheduler.spec
        free = dataclasses.replace(sp.drafter.cost, unit=0.0, prior=0.9)   # make it draft anyway
        sp.policy = dataclasses.replace(sp.policy, cost=speculate.CostModel((1, 16), (1.0, 1.0)), draft=free, k_max=1)
        sp.drafter.cost = free
        sp.drafter.observe = lambda *a: None
        (_, d), = run(loop, [chat(PROMPTS[1], "mtp")])
        assert d.timings.draft_n > 10 and d.timings.draft_n_accepted <= 0.1 * d.timings.draft_n
    finally:
        loop.close()


def test_the_agreeing_heads_first_drafts_are_accepted_at_its_measured_rate(mtp):
    sp = mtp.scheduler.spec
    prior = mtp.measured.draft.prior
    assert prior > 0.1
    saved = sp.policy
    sp.policy = dataclasses.replace(saved, k_max=1)   # one drafted token a step: the first only
    try:
        done = [run(mtp, [chat(t, "mtp", cache=False)])[0][1] for t in PROMPTS]
    finally:
        sp.policy = saved
    rate = sum(d.timings.draft_n_accepted for d in done) / sum(d.timings.draft_n for d in done)
    assert abs(rate - prior) < 0.25, (rate, prior)


def test_the_policy_offers_mtp_only_where_exact_or_labelled():
    """decide() with an MTP head: exact, auto drafts by it; not exact, --speculate mtp refuses
    to start with the reason and --speculate-inexact labels every response mtp-inexact."""
    cost, head = speculate.CostModel(), speculate.DraftCost(0.1, speculate.CostModel(), 0.6)
    exact, inexact = speculate.Exactness(True, 0.0, 0, 9), speculate.Exactness(False, 0.6, 0, 9)
    p = speculate.decide("auto", False, exact, cost, head, "mtp", "unused")
    assert p.default == "mtp" and p.modes == ("lookup", "mtp") and p.refusal("mtp") is None
    assert p.refusal("draft") == "this server has no draft model (start it with --draft-model)"
    with pytest.raises(ValueError, match="--speculate mtp: .*--speculate-inexact"):
        speculate.decide("mtp", False, inexact, cost, head, "mtp")
    opted = speculate.decide("mtp", True, inexact, cost, head, "mtp")
    assert opted.default == "mtp" and opted.label("mtp") == "mtp-inexact"
    lookup_only = speculate.decide("auto", False, exact, cost, None, "draft", "no head here")
    assert lookup_only.refusal("mtp") == "no head here" and lookup_only.as_dict()["mtp_refusal"] == "no head here"


def test_a_model_without_next_n_layers_refuses_mtp(tmp_path):
    path = tmp_path / "trunk-only.gguf"
    write_tiny_mtp(path, mtp=False)
    with pytest.raises(ModelLoadError, match=r"--speculate mtp: the model \(glm4moe\) has no next-n \(MTP\) layers"):
        engine(path, "mtp")
    loop = engine(path)            # auto: lookup only, and a request for "mtp" is told why
    try:
        p = loop.scheduler.spec.policy
        assert "mtp" not in p.modes and p.default == "lookup"
        assert "no next-n (MTP) layers" in loop.info.settings["speculation"]["mtp_refusal"]
        loop.submit(chat("hi", "mtp"))
        (err,) = [e for e in loop.outbox if isinstance(e, Error)]
        assert "no next-n (MTP) layers" in err.message
    finally:
        loop.close()


# -- the head in a sidecar: mtp-NAME.gguf beside a trunk converted without it ---------------------

@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """`mtp`'s model (the same seed, the same weights) in two files as llama.cpp's converter
    publishes it: the trunk and mtp-NAME.gguf beside it, which the runner finds."""
    trunk, _ = write_split_mtp(tmp_path_factory.mktemp("split"), agree=True)
    loop = drafting_free(engine(trunk))
    yield loop
    loop.close()


def test_the_sidecar_beside_a_trunk_is_its_head(split, mtp):
    r = split.runner
    assert r.head_source.name == "mtp-tiny-glm-Q4_1.gguf" and r.head_model is not None and r.nextn is not None
    assert split.measured.default == "mtp" and split.measured.modes == ("lookup", "mtp")
    report = split.info.settings["speculation"]
    assert report["mtp"] == {"arch": MTP_ARCH, "n_embd": 128, "source": "mtp-tiny-glm-Q4_1.gguf"}
    # the same head on the same trunk rows: the agreement measured at start is the bundled head's
    assert split.measured.draft.prior == mtp.measured.draft.prior > 0.1


def test_the_sidecar_drafts_as_the_bundled_head_and_changes_nothing(split, mtp):
    """Greedy and seeded: the split model's output with MTP equals its output without, token for
    token, and it drafts and accepts exactly what the bundled file of the same weights does
    (each request starts with both heads' KV empty and the prompt cache off)."""
    reqs = [("Describe a quiet harbour at dawn in two sentences.", 0.0, None),
            ("Name a river, a mountain and a city, then say which is oldest.", 0.8, 3)]
    split_on, bundled_on = [], []
    for text, temp, seed in reqs:
        for loop, out in ((split, split_on), (mtp, bundled_on)):
            loop.scheduler.spec.drafter.reset()
            out.append(run(loop, [chat(text, "mtp", temp, seed, cache=False)])[0])
    off = [run(split, [chat(text, "off", temp, seed, cache=False)])[0][0] for text, temp, seed in reqs]
    assert [t for t, _ in split_on] == off == [t for t, _ in bundled_on]
    drafts = [[(d.timings.draft_n, d.timings.draft_n_accepted) for _, d in out] for out in (split_on, bundled_on)]
    assert drafts[0] == drafts[1]
    assert 0 < sum(a for _, a in drafts[0]) < sum(n for n, _ in drafts[0])   # drafts both accepted and cut


def test_a_trunk_without_its_sidecar_refuses_mtp(tmp_path):
    """A trunk that still counts its next-n layer, alone: llama.cpp loads it, --speculate mtp
    refuses naming the missing sidecar, auto serves with lookup (an MTP context made against
    it would abort the process)."""
    trunk, head = write_split_mtp(tmp_path, counted=True)
    head.unlink()
    with pytest.raises(ModelLoadError, match=r"--speculate mtp: the model \(glm4moe\) counts 1 next-n \(MTP\) "
                                             r"layer\(s\) but its GGUF leaves the block out .*an mtp-\*\.gguf"):
        engine(trunk, "mtp")
    loop = engine(trunk)
    try:
        p = loop.scheduler.spec.policy
        assert "mtp" not in p.modes and loop.runner.nextn is None
        assert "give it with --mtp-model PATH" in loop.info.settings["speculation"]["mtp_refusal"]
    finally:
        loop.close()


def test_a_sidecar_that_does_not_fit_refuses_to_start(tmp_path):
    trunk, _ = write_split_mtp(tmp_path)
    narrow = tmp_path / "mtp-narrow.gguf"
    write_tiny_mtp(narrow, dims=MtpDims(n_embd=64, n_head=2, n_head_kv=1), part="head")
    with pytest.raises(ModelLoadError, match=r"--mtp-model .*mtp-narrow.gguf: its width is 64 and the model's 128"):
        engine(trunk, mtp_model=str(narrow))
