"""Engine start-up: from a config to a loaded, warm engine whose parts are wired together.

    tuned plan -> runner -> warm-up -> prompt builder
               -> device check: the GPU's logits against the CPU's (llama.cpp's CPU backend or the
                  torch runner's CPU path; device_check.py)
               -> speculation: exactness check, measured costs, draft model -> policy
               -> prefill grid: chunk-invariance check -> prompt cache (slot, RAM and disk tiers)
               -> scheduler

`start` returns them as one `Engine`; `/health` 200 means all of this has happened (a request
never pays for graph allocation or page faults of the first forward). What was decided is
reported in `Engine.info.settings`: the runner's own settings plus the scheduler's grid and
budget, the plan's status and the speculation policy. With --embedding-model chat the engine
also embeds (an `Embedder` over a second llama.cpp context on the same weights);
`start_embedding` is an embedding model's engine, an `Embedder` and no scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .. import engine_choice
from ..config import EngineConfig
from ..engine_choice import EngineChoice
from ..errors import ModelLoadError
from ..fit.gguf_header import read_header
from ..models import resolve
from ..rope import ModelRope
from . import device_check, plan as plan_mod
from .cache import kvfile
from .cache.disk import WRITE_QUEUE_BYTES, DiskTier
from .cache.invariance import CANDIDATES, ChunkInvariance, check_chunk_invariance, probe_prompt
from .cache.prompt_cache import PromptCache
from .cache.ram import index_block
from .embed import Embedder, EmbeddingContext
from .grid import Grid
from .probe_memo import ProbeMemo
from .probe_memo import digest as _digest
from .prompts import PromptBuilder
from .runners import make_runner
from .runners.base import ModelRunner, RunnerInfo, Span
from .sched.scheduler import Scheduler
from .spec import CostModel, DraftCost, Exactness, Speculator, decide, probe
from .spec.draft import SAMPLE, DraftModel, check_vocab
from .spec.mtp import MtpDrafter
from .spec.shape import fixed_shape
from .types import Event

log = logging.getLogger("appliance.engine")

# the verify's 9 rows cross position 256, where llama.cpp's flash attention starts to split a
# step's keys over threads, then 1,024, where the torch runner's decode attention changes path
EXACTNESS_AT = (252, 1020)


@dataclass
class Engine:
    info: RunnerInfo             # the runner's, with what the engine adds in `settings`
    runner: ModelRunner
    prompts: PromptBuilder
    scheduler: Scheduler | None  # None: an embedding model, which only embeds
    embedder: Embedder | None = None

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.cache.close()     # the disk tier's writer thread
        if self.embedder is not None:
            self.embedder.close()            # its context before the weights it reads
        if self.scheduler is not None and self.scheduler.spec.drafter is not None:
            self.scheduler.spec.drafter.close()
        self.runner.close()


def start(cfg: EngineConfig, emit: Callable[[Event], None]) -> Engine:
    """Load the model `cfg` names and make every part of the engine; events go to `emit`."""
    ref = resolve(cfg.model, cfg.model_alias)
    t0 = time.perf_counter()
    cfg, runner, chosen, plan = _runner(cfg, ref)
    if chosen is not None:
        runner.info.settings["engine_choice"] = chosen.as_dict()
    info = _with_settings(_with_template(runner.info, cfg), thread_wait=cfg.thread_wait,
                          prefill_chunk=cfg.prefill_chunk, step_token_budget=cfg.step_token_budget,
                          prompt_cache=cfg.prompt_cache, plan=plan.as_dict())
    prompts = PromptBuilder(runner, info, cfg.template_kwargs(), cfg.reasoning_format)
    warm_up(runner, info)
    info = _with_settings(info, device_check=device_check.at_start(cfg.device_check, runner, cfg=cfg))
    spec = speculation(cfg, runner)
    grid, reuse = prefill_grid(cfg, runner)
    info = _with_settings(info, speculation=_speculation_report(spec), prompt_cache_reuse=reuse)
    cache = PromptCache.from_config(runner, cfg, disk_tier(cfg, runner, grid), grid)
    scheduler = Scheduler(runner, cfg, emit, cache, spec)
    embedder = None
    if cfg.embedding_model == "chat":
        from .runners.embedding import for_chat_model

        ctx = for_chat_model(runner)
        embedder = _embedder(ctx, runner, prompts, emit)
        info = _with_settings(info, embeddings=ctx.report())
    # the settings were each said as they were decided (placement, speculation, prompt cache);
    # the whole dict is /health's "settings"
    log.info("loaded %s (%s) in %.2f s: %d slots %s %d positions, KV pool %.1f MiB; context: %s",
             ref.path.name, info.arch, time.perf_counter() - t0, info.n_slots, "sharing" if info.kv_unified else "x",
             info.n_ctx, info.kv_bytes / 2**20,
             info.settings.get("context", "-"))
    log.debug("settings: %s", info.settings)
    return Engine(info, runner, prompts, scheduler, embedder)


def _runner(cfg: EngineConfig, ref) -> tuple[EngineConfig, ModelRunner, EngineChoice | None, plan_mod.Resolved]:
    """The runner --engine names, `auto` resolved by the tuned plan (engine_choice.py), with the
    plan's settings for it: a torch runner it chose that refuses the model falls back to
    llama.cpp, saying why. A draft model is measured against the target at start: the target
    then waits for its kernels."""
    cfg, chosen = engine_choice.resolve(cfg, ref.path)
    if chosen is not None:
        log.info("--engine auto: %s (%s: %s)", chosen.engine, chosen.by, chosen.reason)
    tuned, plan = plan_mod.apply(cfg, ref.path)
    try:
        return tuned, make_runner(tuned, ref.path, ref.alias, defer_kernels=cfg.draft_model is None), chosen, plan
    except ModelLoadError as e:
        if chosen is None or chosen.engine != "torch":
            raise
        cfg, chosen = engine_choice.fallback(cfg, chosen, e.message)
        log.warning("--engine auto: %s", chosen.reason)
        tuned, plan = plan_mod.apply(cfg, ref.path)
        return tuned, make_runner(tuned, ref.path, ref.alias, defer_kernels=cfg.draft_model is None), chosen, plan


def upgrade_ready(engine: Engine) -> bool:
    """Whether the runner has something to move to (`upgrade`): its CPU kernels, built after a
    start that did not wait for them."""
    ready = getattr(engine.runner, "upgrade_ready", None)
    return engine.scheduler is not None and ready is not None and ready()


def upgrade(engine: Engine, cfg: EngineConfig) -> bool:
    """Move a running engine onto what its runner now computes with (`TorchRunner.upgrade`),
    with no request in a slot: everything measured on the runner at start is measured again
    (warm-up, exactness and verify costs, chunk invariance), and the prompt cache starts empty
    under the new KV fingerprint (its disk tier deletes the files of the old one). Requests
    waiting meanwhile keep their place. True when it moved; `engine.info` is then the new one."""
    if engine.scheduler is None or not engine.runner.upgrade():
        return False
    t0 = time.perf_counter()
    runner = engine.runner
    info = _with_settings(engine.info, **runner.info.settings)
    if "cpu_kernels_note" not in runner.info.settings:
        info.settings.pop("cpu_kernels_note", None)
    warm_up(runner, info)
    spec = speculation(cfg, runner)
    grid, reuse = prefill_grid(cfg, runner)
    engine.scheduler.cache.close()           # its writer, before the new tier sweeps the directory
    cache = PromptCache.from_config(runner, cfg, disk_tier(cfg, runner, grid), grid)
    engine.scheduler.rewire(cache, spec)
    engine.info = _with_settings(info, speculation=_speculation_report(spec), prompt_cache_reuse=reuse)
    log.info("engine moved in %.2f s: %s", time.perf_counter() - t0, engine.info.settings)
    return True


def start_embedding(cfg: EngineConfig, emit: Callable[[Event], None]) -> Engine:
    """An embedding model's engine (--embedding-model PATH): its vocabulary and an embeddings
    context behind an `Embedder`, no scheduler."""
    from .runners.embedding import EmbeddingRunner

    ref = resolve(cfg.model, cfg.model_alias)
    t0 = time.perf_counter()
    runner = EmbeddingRunner(cfg, ref.path, ref.alias)
    prompts = PromptBuilder(runner, runner.info)
    embedder = _embedder(runner.embeddings, runner, prompts, emit)
    log.info("loaded embedding model %s (%s) in %.2f s: %s", ref.path.name, runner.info.arch,
             time.perf_counter() - t0, runner.info.settings["embeddings"])
    return Engine(runner.info, runner, prompts, None, embedder)


def _embedder(ctx: EmbeddingContext, runner: ModelRunner, prompts: PromptBuilder,
              emit: Callable[[Event], None]) -> Embedder:
    """Texts tokenized as llama-server tokenizes an embeddings input (special tokens added, where
    a piece starts the input, and parsed), warmed up."""
    embedder = Embedder(ctx, lambda text, special: runner.tokenize(text, add_special=special, parse_special=True),
                        prompts.check_ids, emit)
    embedder.warm_up(runner.info.bos_id or 0)
    return embedder


def _with_settings(info: RunnerInfo, **more) -> RunnerInfo:
    return dataclasses.replace(info, settings={**info.settings, **more})


def _with_template(info: RunnerInfo, cfg: EngineConfig) -> RunnerInfo:
    """The runner's info with --chat-template in place of the GGUF's template, so the prompts, the
    tool-call format, the thinking markers and /health all see the template in use."""
    override = cfg.template_override()
    if override is not None:
        source, template = override
        log.info("chat template: %s", source)
        return dataclasses.replace(info, chat_template=template, chat_template_source=source)
    if info.chat_template is None:
        return dataclasses.replace(info, chat_template_source="fallback:chatml")
    return info


def warm_up(runner: ModelRunner, info: RunnerInfo) -> None:
    """One small prefill and one decode step, so the first request does not pay for graph
    allocation and page faults (`/health` says ready only after this)."""
    tok = info.bos_id if info.bos_id is not None else 0
    runner.forward([Span(0, (tok,) * 8, 0, 1)])
    runner.forward([Span(0, (tok,), 8, 1)])
    runner.truncate(0, 0)


def prefill_grid(cfg: EngineConfig, runner: ModelRunner) -> tuple[Grid, dict]:
    """The grid prompts are cut on, and how finely the prompt cache may reuse: to the token if
    the loaded runner computes every cut a cache hit makes as the grid does (proven here,
    bit for bit), else at grid lines. With the cache off nothing is reused and nothing probed."""
    if not cfg.prompt_cache_on:
        return Grid(cfg.prefill_chunk), {"mode": "off"}
    t0 = time.perf_counter()
    prompt = probe_prompt(runner, cfg.prefill_chunk)
    found = ProbeMemo(cfg.probe_cache, runner)(
        "chunk-invariance", {"prompt": _digest(prompt), "chunk": cfg.prefill_chunk, "candidates": CANDIDATES},
        lambda: check_chunk_invariance(runner, 0, prompt, cfg.prefill_chunk), ChunkInvariance)
    grid = Grid(cfg.prefill_chunk, found.min_chunk)
    how = (f"to the token, at least {found.min_chunk} recomputed" if found.min_chunk
           else f"in whole {cfg.prefill_chunk}-token blocks")
    log.info("prompt cache: exact reuse %s (chunk invariance: %d cuts compared in %.2f s%s)", how, found.cases,
             time.perf_counter() - t0, "; " + "; ".join(found.failed) if found.failed else "")
    return grid, {"mode": cfg.prompt_cache, "exact_reuse": how, **found.as_dict()}


def disk_tier(cfg: EngineConfig, runner: ModelRunner, grid: Grid) -> DiskTier | None:
    """The prompt cache's disk tier. A saved state is valid only under its fingerprint
    (`kvfile.fingerprint`): files of another fingerprint are deleted at start. Its files are
    written by a thread of their own, behind a queue of at most WRITE_QUEUE_BYTES."""
    if not cfg.prompt_cache_on or cfg.cache_disk_bytes <= 0:
        return None
    fingerprint = kvfile.fingerprint(runner.kv_fingerprint(), grid.chunk, grid.min_chunk)
    return DiskTier(cfg.resolved_cache_dir(), cfg.cache_disk_bytes, fingerprint, index_block(grid.chunk),
                    queue_bytes=WRITE_QUEUE_BYTES)


PROBE_TEXT = "The quick brown fox jumps over the lazy dog. " * 120   # the verify probes' prompt
UNIFIED_WHY = ("in a KV pool the slots share (--kv-unified) a verify's rows may take other cells than k steps' "
               "would, and llama.cpp's sums then round differently")


def verify_probes(runner: ModelRunner, ids: Sequence[int], memo: ProbeMemo,
                  costs: bool = False) -> tuple[Exactness, CostModel, list[int]]:
    """(whether a k-row verify equals k one-row steps at each of EXACTNESS_AT, what a forward of
    m rows costs when it does or `costs`, the cost probe's prompt) on the loaded runner. The
    raw workers of `bench`/`tune` ask the same (bench/raw_run.py), so tune's speculation is
    serve's."""
    exactness = None
    for at in EXACTNESS_AT:  # a context too small for a position checks what fits
        n = max(1, min(at, runner.info.n_ctx - 12))
        exactness = memo("verify-exactness", {"prompt": _digest(ids[:n]), "k": 8},
                         lambda: probe.check_exact(runner, 0, ids[:n], k=8), Exactness)
        if not exactness.exact or n < at:
            break
    assert exactness is not None
    prompt = list(ids[:48])
    cost = CostModel()
    if exactness.exact or costs:
        cost = memo("verify-costs", {"prompt": _digest(prompt), "rows": probe.COST_ROWS},
                    lambda: probe.measure_costs(runner, 0, prompt), CostModel)
    return exactness, cost, prompt


def speculation(cfg: EngineConfig, runner: ModelRunner) -> Speculator:
    """Prove on the loaded model whether a k-row verify equals k one-row steps, measure what a
    forward of m rows costs, load the draft model if one is named, and decide (spec.decide)."""
    if cfg.speculate == "off":
        return Speculator()
    no_mtp = mtp_refusal(runner)
    if cfg.speculate == "mtp" and no_mtp is not None:
        raise ModelLoadError(f"--speculate mtp: {no_mtp}")
    ids = runner.tokenize(PROBE_TEXT, add_special=False)
    memo = ProbeMemo(cfg.probe_cache, runner)
    exactness, cost, prompt = verify_probes(runner, ids, memo, costs=cfg.speculate_inexact)
    shape, fixed, fixed_cost = fixed_shape(cfg.fixed_shape, cfg.fixed_shape_rows, runner, ids, memo, exactness)
    if fixed is not None and fixed_cost is not None:   # the runner now decodes at that shape (spec/shape.py)
        exactness, cost = fixed, fixed_cost
    if runner.info.kv_unified and exactness.exact:
        exactness = dataclasses.replace(exactness, exact=False, why=UNIFIED_WHY)
    drafter = None
    if exactness.exact or cfg.speculate_inexact:
        if cfg.draft_model is not None and cfg.speculate in ("auto", "draft"):
            drafter = load_draft(cfg, runner, cost, prompt)
            no_mtp = no_mtp or "this server drafts with its --draft-model (MTP drafts without one)"
        elif no_mtp is None and cfg.speculate in ("auto", "mtp"):
            drafter = load_mtp(runner, cost, prompt)
    try:
        policy = decide(cfg.speculate, cfg.speculate_inexact, exactness, cost,
                        drafter.cost if drafter is not None else None,
                        getattr(drafter, "mode", "draft"), no_mtp or "MTP drafting is not loaded", shape)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    log.info("speculation: %s (%s); verify cost by rows %s", policy.default, policy.reason, policy.cost.as_dict())
    return Speculator(policy, drafter)


ROPE_FIELDS = ("rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx",
               "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")


def draft_rope(path: Path, n_ctx: int) -> dict[str, object]:
    """The draft model's rotation: its own GGUF's (the RoPE flags are the served model's), and
    YaRN to the served context where that is past what it was trained for and it declares no
    scaling of its own; its drafts are verified, so a draft past its training costs only
    acceptance, never output."""
    flags: dict[str, object] = dict.fromkeys(ROPE_FIELDS)
    if path.is_dir():      # a checkpoint: its config's rope_scaling, read by the torch runner
        return flags
    meta, _ = read_header(path)
    model = ModelRope.from_meta(meta.get, str(meta.get("general.architecture", "")))
    if model.n_ctx_train and n_ctx > model.n_ctx_train and not model.scaled:
        flags.update(rope_scaling="yarn", rope_scale=math.ceil(n_ctx / model.n_ctx_train))
        log.info("draft model %s: trained for %d positions, drafting at %d with YaRN x%d",
                 path.name, model.n_ctx_train, n_ctx, flags["rope_scale"])
    return flags


def load_draft(cfg: EngineConfig, target: ModelRunner, cost: CostModel, prompt: Sequence[int]) -> DraftModel:
    """Load --draft-model with the target's slots and context, check that it shares the
    vocabulary, and measure what its forwards cost against the target's and how often its
    argmax agrees with the target's (the acceptance prior)."""
    ref = resolve(None if cfg.draft_model == "embedded" else cfg.draft_model)
    dcfg = dataclasses.replace(cfg, engine=cfg.draft_engine or cfg.engine, n_ctx=target.info.n_ctx,
                               expert_cache="auto", expert_compute="auto", mtp_model=None,   # the served model's
                               kv_unified=False,       # a stream per slot: never short of cells a target holds
                               **draft_rope(ref.path, target.info.n_ctx))
    runner = make_runner(dcfg, ref.path, ref.alias)
    try:
        check_vocab(runner, target, str(ref.path))
        drafter = DraftModel(runner, target.info.n_vocab, Grid(cfg.prefill_chunk))
        prior = drafter.agreement(target, 0, target.tokenize(SAMPLE, add_special=True))
        dcost = probe.measure_costs(runner, 0, prompt)
    except BaseException:
        runner.close()
        raise
    unit = dcost.unit_s / cost.unit_s if cost.unit_s > 0 else 1.0
    log.info("draft model %s (%s): one forward %.2f of the target's, argmax agreement %.0f%%",
             ref.path.name, runner.info.backend, unit, 100 * prior)
    drafter.cost = DraftCost(unit, dcost, prior)
    return drafter


def mtp_refusal(runner: ModelRunner) -> str | None:
    """Why this runner cannot draft with the model's own MTP head (None: it can)."""
    if not hasattr(runner, "mtp_refusal"):
        return (f"the {runner.info.backend} runner has no MTP head; MTP drafting runs on llama.cpp "
                "(--engine llamacpp)")
    return runner.mtp_refusal


def load_mtp(runner: ModelRunner, cost: CostModel, prompt: Sequence[int]) -> MtpDrafter:
    """The model's own MTP head as the drafter: how often its argmax agrees with the target's
    (the acceptance prior) and what its forwards cost against the target's, measured."""
    runner.start_mtp()
    drafter = MtpDrafter(runner)
    prior = drafter.agreement(0, runner.tokenize(SAMPLE, add_special=True))
    drafter.cost = dataclasses.replace(drafter.measure(0, prompt, cost.unit_s), prior=prior)
    log.info("MTP head (%s, %s): one forward %.2f of the target's, argmax agreement %.0f%%",
             runner.info.arch, runner.head_source.name, drafter.cost.unit, 100 * prior)
    return drafter


def _speculation_report(spec: Speculator) -> dict:
    """/health's settings.speculation: the policy, and the draft model or MTP head when there is one."""
    report = spec.policy.as_dict()
    if spec.model_mode == "mtp" and spec.drafter is not None:
        report["mtp"] = {"arch": spec.drafter.runner.info.arch, "n_embd": spec.drafter.head.n_embd,
                         "source": spec.drafter.runner.head_source.name}   # "bundled" or the sidecar's file
    elif spec.drafter is not None:
        d = spec.drafter.runner.info
        report["draft_model"] = {"path": d.model_path, "name": d.model_name, "backend": d.backend,
                                 "arch": d.arch, "settings": d.settings}
    return report
