"""The engine process's main loop: commands in, one scheduler step, events out.

Prompt preparation lives here, on the engine side of the boundary: the chat template is
rendered and the text tokenized next to the model, and token ids from a client are checked
against the vocabulary, so the server never tokenizes. The API's /tokenize and /detokenize
are commands answered as soon as they are read, between scheduler steps.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

from .. import __version__
from ..config import EngineConfig
from ..errors import ApplianceError, EngineFailure, InvalidToken, ModelLoadError
from ..models import file_fingerprint, resolve
from . import plan as plan_mod
from .chat import ChatTemplate
from . import probe, speculate, tools
from .draft import SAMPLE, DraftModel, check_vocab
from .constraints import Constraints
from .prefix_cache import DiskTier
from .output import OutputParser
from .reasoning import ReasoningParser, markers_for, prompt_opens_thinking
from .runners.base import Span
from .scheduler import Scheduler
from .types import Constraint, Error, Event, Request, Tokenized

log = logging.getLogger("appliance.engine")

STATS_INTERVAL_S = 0.1
IDLE_PERSIST_S = 1.0   # idle this long, the engine writes kept prompt states to the disk tier


def apply_plan(cfg: EngineConfig, model_path: Path) -> tuple[EngineConfig, plan_mod.Resolved]:
    """Fill the llama.cpp settings left at their defaults from the tuned plan's entry for this
    model at the working depth (half the context: llama.cpp fixes these per context, so one
    entry is used for the whole run). Flags and environment variables that set them win."""
    path, explicit = cfg.resolved_plan()
    if path is None:
        return cfg, plan_mod.Resolved("off")
    if cfg.engine != "llamacpp":  # the plan holds llama.cpp settings only, for now
        return cfg, plan_mod.Resolved("off", reason=f"the plan has no entries for --engine {cfg.engine}")
    fingerprint = plan_mod.current_fingerprint(plan_mod.llama_cpp_build())
    depth = (cfg.n_ctx or 8192) // 2
    choice, resolved = plan_mod.resolve(path, explicit, fingerprint, file_fingerprint(model_path), depth)
    if choice is None:
        return cfg, resolved
    defaults = EngineConfig()
    wanted = {k: v for k, v in choice.settings().items() if getattr(cfg, k) == getattr(defaults, k)}
    if cfg.prefill_chunk > wanted.get("n_batch", cfg.n_batch):
        wanted["n_batch"] = cfg.prefill_chunk  # a prompt chunk must fit one llama_decode
    return dataclasses.replace(cfg, **wanted), resolved


def make_runner(cfg: EngineConfig, model_path: Path, alias: str):
    """The runner `--engine` names; each imports its backend only when chosen."""
    if cfg.engine == "torch":
        try:
            from .runners.torch.runner import TorchRunner
        except ImportError as e:
            raise ModelLoadError(f"--engine torch needs PyTorch, which is not installed ({e}); "
                                 "install the torch extra: pip install 'appliance[torch]'") from None
        return TorchRunner(cfg, model_path, alias)
    from .runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(cfg, model_path, alias)


class EngineLoop:
    def __init__(self, cfg: EngineConfig) -> None:
        ref = resolve(cfg.model, cfg.model_alias)
        t0 = time.perf_counter()
        cfg, self.plan = apply_plan(cfg, ref.path)
        self.runner = make_runner(cfg, ref.path, ref.alias)
        # what the scheduler adds to the runner's settings: /health reports both, and a bench's raw
        # reference row prefills on the same chunk grid
        self.info = dataclasses.replace(self.runner.info, settings={
            **self.runner.info.settings, "prefill_chunk": cfg.prefill_chunk,
            "step_token_budget": cfg.step_token_budget, "prompt_cache": cfg.prompt_cache,
            "plan": self.plan.as_dict()})
        self.template = ChatTemplate(self.info.chat_template, self.info.bos_text, self.info.eos_text)
        self.tool_format = tools.detect_format(self.info.chat_template)
        self.think_markers = markers_for(self.info.chat_template)
        if self.template.load_warning:
            log.warning("%s", self.template.load_warning)
        self.constraints = Constraints(self.runner.guidance_tokenizer, self.info.n_vocab)
        self._warm_up()
        self.outbox: list[Event] = []
        self.drafter: DraftModel | None = None
        self.policy = self._speculation(cfg)
        spec_info = self.policy.as_dict()
        if self.drafter is not None:
            d = self.drafter.runner.info
            spec_info["draft_model"] = {"path": d.model_path, "name": d.model_name, "backend": d.backend,
                                        "arch": d.arch, "settings": d.settings}
        self.info = dataclasses.replace(self.info, settings={**self.info.settings, "speculation": spec_info})
        self.scheduler = Scheduler(self.runner, cfg, self.outbox.append, self._disk_tier(cfg), self.policy,
                                   self.drafter)
        log.info("loaded %s (%s) in %.2f s: %d slots x %d positions, KV pool %.1f MiB, %s",
                 ref.path.name, self.info.arch, time.perf_counter() - t0, self.info.n_slots,
                 self.info.n_ctx, self.info.kv_bytes / 2**20, self.info.settings)

    def _disk_tier(self, cfg: EngineConfig) -> DiskTier | None:
        if not cfg.prompt_cache or cfg.cache_disk_bytes <= 0:
            return None
        # a saved state is only valid for this model file, context, KV type and engine build
        fingerprint = "|".join([self.info.fingerprint, f"n_ctx={self.info.n_ctx}",
                                f"kv={self.info.settings.get('kv_type')}",
                                f"llama_cpp_python={self.info.settings.get('llama_cpp_python')}",
                                # the torch runner's states: another layout, dtype and kernels
                                *(f"{k}={self.info.settings[k]}" for k in
                                  ("torch", "dtype", "device", "int4") if k in self.info.settings),
                                # batch shapes and kernels change the computed KV: a state saved
                                # under other settings would not restore exactly
                                *(f"{k}={self.info.settings.get(k)}" for k in
                                  ("n_batch", "n_ubatch", "flash_attn", "n_threads", "n_threads_batch")),
                                f"appliance={__version__}", f"chunk={cfg.prefill_chunk}"])
        return DiskTier(cfg.resolved_cache_dir(), cfg.cache_disk_bytes, cfg.prefill_chunk, fingerprint)

    def _warm_up(self) -> None:
        """One small prefill and one decode step, so the first request does not pay for graph
        allocation and page faults (`/health` says ready only after this)."""
        tok = self.info.bos_id if self.info.bos_id is not None else 0
        self.runner.forward([Span(0, (tok,) * 8, 0, 1)])
        self.runner.forward([Span(0, (tok,), 8, 1)])
        self.runner.truncate(0, 0)

    def _speculation(self, cfg: EngineConfig) -> speculate.Policy:
        """Prove on the loaded model whether a k-row verify equals k one-row steps, measure what
        a forward of m rows costs, and decide (see speculate.decide)."""
        if cfg.speculate == "off":
            return speculate.Policy()
        text = "The quick brown fox jumps over the lazy dog. " * 120
        ids = self.runner.tokenize(text, add_special=False)
        # the verify's 9 rows cross position 256, where llama.cpp's flash attention starts to
        # split a step's keys over threads, then 1,024, where the torch runner's decode
        # attention changes path (a context too small for that checks what fits)
        exactness = None
        for at in (252, 1020):
            n = max(1, min(at, self.info.n_ctx - 12))
            exactness = probe.check_exact(self.runner, 0, ids[:n], k=8)
            if not exactness.exact or n < at:
                break
        prompt = ids[:48]
        cost = speculate.CostModel()
        draft = None
        if exactness.exact or cfg.speculate_inexact:
            cost = probe.measure_costs(self.runner, 0, prompt)
            if cfg.draft_model is not None and cfg.speculate in ("auto", "draft"):
                draft = self._load_draft(cfg, cost, prompt)
        try:
            policy = speculate.decide(cfg.speculate, cfg.speculate_inexact, exactness, cost, draft)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        log.info("speculation: %s (%s); verify cost by rows %s", policy.default, policy.reason,
                 policy.cost.as_dict())
        return policy

    def _load_draft(self, cfg: EngineConfig, cost: speculate.CostModel,
                    prompt: Sequence[int]) -> speculate.DraftCost:
        """Load --draft-model with the target's slots and context, check that it shares the
        vocabulary, and measure what its forwards cost against the target's and how often its
        argmax agrees with the target's (the acceptance prior)."""
        ref = resolve(None if cfg.draft_model == "embedded" else cfg.draft_model)
        dcfg = dataclasses.replace(cfg, engine=cfg.draft_engine or cfg.engine, n_ctx=self.info.n_ctx)
        runner = make_runner(dcfg, ref.path, ref.alias)
        try:
            check_vocab(runner, self.runner, str(ref.path))
            self.drafter = DraftModel(runner, self.info.n_vocab, cfg.prefill_chunk)
            sample = self.runner.tokenize(SAMPLE, add_special=True)
            prior = self.drafter.agreement(self.runner, 0, sample)
            dcost = probe.measure_costs(runner, 0, prompt)
        except BaseException:
            self.drafter = None
            runner.close()
            raise
        unit = dcost.unit_s / cost.unit_s if cost.unit_s > 0 else 1.0
        log.info("draft model %s (%s): one forward %.2f of the target's, argmax agreement %.0f%%",
                 ref.path.name, runner.info.backend, unit, 100 * prior)
        self.drafter.cost = speculate.DraftCost(unit, dcost, prior)
        return self.drafter.cost

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats(), "kv_bytes": self.info.kv_bytes}

    # -- prompts -------------------------------------------------------------------------
    def prompt_ids(self, req: Request) -> tuple[list[int], str]:
        """The prompt's tokens, and its text (empty when the client sent token ids)."""
        if req.prompt_ids is not None:
            self._check_ids(req.prompt_ids, "prompt")
            return list(req.prompt_ids), ""
        if req.messages is not None:
            messages, kwargs = req.messages, dict(req.template_kwargs)
            if req.tools and req.tool_choice != "none":
                if self.tool_format == "generic":
                    messages = tools.with_generic_tools(messages, req.tools)
                else:
                    kwargs["tools"] = tools.tool_dicts(req.tools)
            text = self.template.render(messages, req.add_generation_prompt, **kwargs)
        else:
            text = req.prompt or ""
        ids = self.runner.tokenize(text, add_special=True, parse_special=True)
        bos = self.info.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote a BOS and the tokenizer added one
        return ids, text

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.info.n_vocab]
        if bad:
            raise InvalidToken(f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.info.n_vocab})", param=param)

    def _failed(self, request_id: str, e: Exception) -> Error:
        """The Error event for a request that could not be served: a bug fails it, not the engine."""
        if isinstance(e, ApplianceError):
            return Error(request_id, *e.to_wire())
        log.exception("request %s failed", request_id)
        return Error(request_id, *EngineFailure(f"internal engine error: {type(e).__name__}").to_wire())

    def tokens(self, msg: tuple) -> Event:
        """The one event answering ("tokenize", id, text, add_special, parse_special, with_pieces)
        or ("detokenize", id, token_ids)."""
        kind, request_id, *args = msg
        try:
            if kind == "tokenize":
                text, add_special, parse_special, with_pieces = args
                ids = self.runner.tokenize(text, add_special, parse_special)
                pieces = tuple(self.runner.detokenize([t]) for t in ids) if with_pieces else ()
                return Tokenized(request_id, tuple(ids), pieces)
            (ids,) = args
            self._check_ids(ids, "tokens")
            return Tokenized(request_id, tuple(ids), text=self.runner.detokenize(ids).decode(errors="replace"))
        except Exception as e:
            return self._failed(request_id, e)

    def submit(self, req: Request) -> None:
        try:
            ids, text = self.prompt_ids(req)
            constraint, tool_parser, parser = req.constraint, None, None
            if req.tools and req.tool_choice != "none":
                names = {t.name for t in req.tools}
                tool_parser = tools.StreamParser(self.tool_format, names)
                if req.tool_choice != "auto":  # required, or one named function: never downgraded
                    grammar = tools.grammar(req.tools, req.tool_choice, req.parallel_tool_calls,
                                            self.tool_format)
                    constraint = Constraint("lark", grammar)
            if req.messages is not None:
                inside = prompt_opens_thinking(text, self.think_markers[0])
                parser = OutputParser(ReasoningParser(inside, self.think_markers), tool_parser)
            matcher = self.constraints.matcher(constraint) if constraint else None
            self.scheduler.submit(req, ids, matcher, parser)
        except Exception as e:
            self.outbox.append(self._failed(req.id, e))

    # -- loop ----------------------------------------------------------------------------
    def run(self, cmd: Connection, evt: Connection) -> None:
        last_stats = 0.0
        busy_at = time.monotonic()
        while True:
            timeout = 0.0 if self.scheduler.has_work() else 0.25
            while cmd.poll(timeout):
                timeout = 0.0
                busy_at = time.monotonic()
                try:
                    msg = cmd.recv()
                except EOFError:
                    return  # the server is gone
                if msg[0] == "submit":
                    self.submit(msg[1])
                elif msg[0] == "abort":
                    self.scheduler.abort(msg[1])
                elif msg[0] in ("tokenize", "detokenize"):
                    self.outbox.append(self.tokens(msg))
                    if not self._send(evt, None):  # answered now, not after the next step
                        return
                elif msg[0] == "stop":
                    self.scheduler.persist()
                    self.close()
                    return
            if self.scheduler.has_work():
                self._step()
                busy_at = time.monotonic()
            elif time.monotonic() - busy_at > IDLE_PERSIST_S:
                # write-behind: one slot's state per idle tick, so a request that arrives
                # meanwhile waits for at most one write, and a restart finds the conversations
                self.scheduler.persist_one()
            now = time.monotonic()
            stats_due = now - last_stats > STATS_INTERVAL_S
            if self.outbox or stats_due:
                if not self._send(evt, self.stats() if stats_due else None):
                    return
                last_stats = now if stats_due else last_stats

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        self.runner.close()

    def _send(self, evt: Connection, stats: dict[str, Any] | None) -> bool:
        """Send the outbox (and stats); False when the server is gone."""
        try:
            evt.send(("events", self.outbox[:], stats))
        except OSError:
            return False
        self.outbox.clear()
        return True

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except ApplianceError as e:
            log.error("step failed: %s", e.message)
            self.scheduler.fail_all(e)
        except Exception as e:  # a bug must fail the requests, not hang them
            log.exception("step failed")
            self.scheduler.fail_all(EngineFailure(f"internal engine error: {type(e).__name__}"))
