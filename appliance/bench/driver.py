"""The driver of `appliance sweep` and `appliance bench` (`bench --soak` too): it ties a plan to
its servers (the one it starts or --url's, or an A/B pair), the model the run claims to measure,
the result store and the host sampler, and says by its exit code how the run ended."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import config
from ..store import ModelFingerprint, RunStatus, Store

if TYPE_CHECKING:   # the measuring modules load when a command runs, not when the CLI parses
    from .raw import RawReference
    from .session import Outcome, Step, Variant


def fail(command: str, message: str) -> int:
    print(f"appliance {command}: {message}", file=sys.stderr)
    return 2


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line, as `appliance serve` flags."""
    out: list[str] = []
    for f in dataclasses.fields(config.EngineConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def drive(command: str, args: argparse.Namespace, argv: Sequence[str],
          plan: Callable[[Any], list[Any]]) -> int:
    """Run `plan` (a Context to its steps) on the servers the arguments name, storing it as it
    goes: 0 when every cell was measured, 1 when some were not, 130 when stopped, 2 refused."""
    from hostcheck.sampler import Sampler

    from ..errors import ApplianceError
    from .client import BenchError
    from .context import Context
    from .envelope import enveloped
    from .session import Prompts, waiting_idle

    refusal = _refusal(args)
    if refusal:
        return fail(command, refusal)
    try:
        cfg = config.load(vars(args))
        claimed, model_path, file_fp = claim(command, args, cfg)
    except (ValueError, TypeError) as e:
        return fail(command, str(e))
    except ApplianceError as e:
        return fail(command, e.message)
    specs = _servers(args, engine_flags(args))
    db_path = cfg.store.resolved_db_path()
    try:
        with contextlib.ExitStack() as stack:
            caps = _power_caps(stack, args, db_path)
            variants = _open_servers(stack, command, args, specs, claimed, file_fp)
            if claimed is None:
                claimed = served_model(variants[0])
            raw = _raw_reference(stack, command, args, model_path, variants, cfg.engine.prefill_chunk)
            sampler = stack.enter_context(Sampler.for_host(interval_s=0.25))
            ctx = Context(variants, raw, sampler, Prompts(variants[0].target))
            steps = waiting_idle(plan(ctx), variants)
            if caps is not None:
                steps = enveloped(steps, caps, args.power_cap)
            store = stack.enter_context(Store.open(db_path))
            run_id, outcome = _execute(store, command, argv, variants, claimed, steps, sampler, not args.quiet,
                                       args.idle_seconds)
    except BenchError as e:
        return fail(command, str(e))
    print(f"stored as run {run_id} in {db_path}" + (f" ({outcome.status.value})" if outcome.missing else ""))
    if outcome.status is RunStatus.COMPLETE:
        return 0
    print(f"appliance {command}: {outcome.note()}", file=sys.stderr)
    return 130 if outcome.status is RunStatus.INTERRUPTED else 1


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments make no run, or None."""
    if args.runs < 1:
        return "--runs must be at least 1"
    if args.url and args.ab:
        return "--ab starts its own two servers; it cannot be used with --url"
    if args.ab and args.against:
        return "--ab and --against each name a second server; give one of them"
    if getattr(args, "power_cap", ()) and (args.ab or args.against):
        return "--power-cap is an A/B setting of its own; it cannot be combined with --ab or --against"
    return None


def _power_caps(stack: contextlib.ExitStack, args: argparse.Namespace, db_path: Any) -> Any:
    """With --power-cap: the host's caps checked (refused at start without permission) and
    restored when the stack closes, however the run ends; else None."""
    if not getattr(args, "power_cap", ()):
        return None
    from pathlib import Path

    from .envelope import PowerCaps

    return stack.enter_context(PowerCaps.for_host(args.power_cap, journal=Path(db_path).parent / "power-caps.json"))


def _open_servers(stack: contextlib.ExitStack, command: str, args: argparse.Namespace, specs: list[Any],
                  claimed: ModelFingerprint | None, file_fp: str | None) -> list[Variant]:
    """Each server of `specs` started (or reached) on `stack` and checked: its Variant."""
    from .client import serving
    from .session import open_variant

    variants = []
    for label, serve_args, url, restart in specs:
        print(f"appliance {command}: {'server ' + label + ': ' if label else ''}" + (
              f"the server at {url}" if url else f"starting appliance serve {shlex.join(serve_args)}"),
              file=sys.stderr)
        target = stack.enter_context(serving(serve_args, url, args.api_key if url == args.url else None,
                                             restart))
        variants.append(open_variant(label, target, claimed, file_fp, serve_args if not url else ()))
    return variants


def _raw_reference(stack: contextlib.ExitStack, command: str, args: argparse.Namespace, model_path: str | None,
                   variants: list[Variant], prefill_chunk: int) -> RawReference | None:
    """The in-process llama.cpp reference on `stack` (a run of one server, without --no-raw), or None."""
    from .session import maybe_raw, off_the_cpu

    want_raw = not args.no_raw and len(variants) == 1
    raw = stack.enter_context(maybe_raw(model_path, variants[0], prefill_chunk, want_raw))
    if want_raw and raw is None and (elsewhere := off_the_cpu(variants[0].health or {})):
        print(f"appliance {command}: no raw reference rows: the server holds weights on {elsewhere}, and the "
              "raw reference computes on the CPU only", file=sys.stderr)
    elif want_raw and raw is None:
        print(f"appliance {command}: no raw reference rows: they need the model file (--model) and "
              "a llama.cpp server that reports its settings in /health", file=sys.stderr)
    return raw


def _execute(store: Store, command: str, argv: Sequence[str], variants: list[Variant], claimed: ModelFingerprint,
             steps: list[Step], sampler: Any, progress: bool, idle_s: float = 0.0) -> tuple[int, Outcome]:
    """Store a run with the host it ran on, measure its steps into it, and print its report:
    (the run's id, how it ended)."""
    from . import report
    from .energy import measure_idle
    from .session import execute, host_snapshot, peak_rss, phase_summary

    settings = (variants[0].settings() if len(variants) == 1
                else {v.label: v.settings() for v in variants})
    snapshot = host_snapshot(variants)
    run_id = store.start_run(["appliance", command, *argv], settings, claimed, kind=command)
    store.record_host(run_id, snapshot, {})
    print(f"appliance {command}: run {run_id}, {len(steps)} cells", file=sys.stderr)
    measure_idle(sampler, idle_s)
    outcome = execute(store, run_id, steps, progress=progress)
    sampler.stop()
    rss = {k: n for v in variants for k, n in peak_rss(v).items()}
    store.record_host(run_id, {**snapshot, "peak_rss_bytes": rss}, phase_summary(sampler))
    store.finish_run(run_id, outcome.status, outcome.note())
    info = store.run(run_id)
    print(report.render_run(info, store.host(run_id), store.results(run_id), "md"))
    return run_id, outcome


def _servers(args: argparse.Namespace, flags: list[str]) -> list[tuple[str, list[str] | None, str | None, str | None]]:
    """(label, serve flags, url, restart command) of each server a run measures: the one it
    starts with `flags` (or --url's); with --against, that one as A and the other server as B;
    with --ab, two it starts, each with its extra flags."""
    here = ("", flags, args.url, getattr(args, "restart_command", None))
    if args.against:
        return [("A", *here[1:]), ("B", None, args.against, getattr(args, "against_restart_command", None))]
    if args.ab:
        return [(label, flags + shlex.split(extra), None, None) for label, extra in zip("AB", args.ab)]
    return [here]


def claim(command: str, args: argparse.Namespace,
          cfg: config.Config) -> tuple[ModelFingerprint | None, str | None, str | None]:
    """The model the run claims to measure (fingerprint, path, file fingerprint): the one the
    started server serves, or --model's with --url; nothing for --url alone."""
    from ..models import file_fingerprint, model_fingerprint, resolve

    if args.model is None and args.url:
        return None, None, None
    ref = resolve(cfg.engine.model, cfg.engine.model_alias)
    print(f"appliance {command}: hashing {ref.path.name} ...", file=sys.stderr)
    return model_fingerprint(ref.path), str(ref.path), file_fingerprint(ref.path)


def served_model(variant: Any) -> ModelFingerprint:
    """What a --url run without --model claims: the server's model id and file fingerprint."""
    fp = (variant.health or {}).get("model_fingerprint") or ""
    size = int(fp.split(":")[0]) if fp and fp.split(":")[0].isdigit() else 0
    return ModelFingerprint(name=variant.model_id, sha256=f"fingerprint:{fp}" if fp else "unknown",
                            quant="unknown", size_bytes=size)


def drive_soak(args: argparse.Namespace, argv: Sequence[str], cfg: config.Config,
               claimed: ModelFingerprint | None, file_fp: str | None) -> int:
    """`bench --soak`'s run on the server it starts (or --url's): 130 when stopped, else 0 only
    when the verdict is PASS. A BenchError once the run is stored marks it failed."""
    from hostcheck.sampler import Sampler

    from . import report, soakreport
    from .client import BenchError, serving
    from .session import host_snapshot, open_variant, peak_rss, phase_summary
    from .soak import Soak, SoakPlan
    from .soakmix import MIN_CTX

    serve_args = engine_flags(args)
    db_path = cfg.store.resolved_db_path()
    plan = SoakPlan(args.soak, args.soak_clients)
    with contextlib.ExitStack() as stack:
        if not args.url:
            print(f"appliance bench: starting a server: appliance serve {shlex.join(serve_args)}", file=sys.stderr)
        target = stack.enter_context(serving(serve_args, args.url, args.api_key))
        variant = open_variant("", target, claimed, file_fp, serve_args if not args.url else ())
        if variant.n_ctx and variant.n_ctx < MIN_CTX:
            raise BenchError(f"--soak needs a context of at least {MIN_CTX} tokens per slot (its largest requests "
                             f"are ~950 tokens with their replies); the server has {variant.n_ctx}")
        claimed = claimed or served_model(variant)
        store = stack.enter_context(Store.open(db_path))
        snapshot = host_snapshot([variant])
        run_id = store.start_run(["appliance", "bench", *argv], variant.settings(), claimed, kind="soak")
        store.record_host(run_id, snapshot, {})
        print(f"appliance bench: run {run_id}, soak of {plan.minutes:g} min with {plan.clients} clients",
              file=sys.stderr)
        sampler = stack.enter_context(Sampler.for_host(interval_s=1.0))
        soak = Soak(target, args.api_key, variant.model_id, variant.n_ctx, plan,
                    lambda batch: store.add_cells(run_id, soakreport.to_cells(batch, plan.clients)),
                    progress=not args.quiet, sampler=sampler)
        try:
            result = soak.run()
        except BenchError as e:
            store.finish_run(run_id, RunStatus.FAILED, str(e))
            raise
        sampler.stop()
        verdict = soakreport.build(result)
        store.record_host(run_id, {**snapshot, "peak_rss_bytes": peak_rss(variant), "soak": soakreport.record(result)},
                          phase_summary(sampler))
        store.finish_run(run_id, *_soak_status(result.interrupted, verdict))
        print(report.render_run(store.run(run_id), store.host(run_id), store.results(run_id), "md"))
    print(f"stored as run {run_id} in {db_path}")
    return 130 if result.interrupted else 0 if verdict.passed else 1


def _soak_status(interrupted: bool, verdict: Any) -> tuple[RunStatus, str]:
    """The stored run's status and note: complete only when the verdict is PASS."""
    from .soakreport import verdict_line

    if interrupted:
        return RunStatus.INTERRUPTED, "stopped by the user; " + verdict_line(verdict)
    return (RunStatus.COMPLETE, "") if verdict.passed else (RunStatus.FAILED, verdict_line(verdict))
