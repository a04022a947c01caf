"""`appliance tune`: measure llama.cpp's settings on this machine once, write the tuned plan.

For each candidate (threads, micro-batch size, flash attention; `plan.candidates`) a raw
llama.cpp worker (the bench's raw reference: nothing of the server in the path) prefills a
prompt of each measured depth and decodes after it. Candidates are alternated inside every
repeat, so drift on a shared machine lands on all of them alike; each figure is the median of
the repeats. The score at a depth is the time of a typical step of work there: one 512-token
prompt chunk at the measured prefill rate plus 128 tokens at the measured decode rate, plus,
for a candidate on which the prompt cache can reuse only whole grid blocks (the engine's
chunk-invariance check fails on it; flash attention with f16 KV passes with pieces of 64 rows,
m = 64), the half block a follow-up turn then recomputes on average. The lowest score wins; a
candidate within `NEAR_TIE` of the best loses to an earlier one (tune_score.py).

`appliance tune --gemm` measures the torch runner's GEMM configurations instead, on the GPU
that will serve (`kernels.plan`: each candidate checked against the reference before it is
timed, per shape and batch bucket, one reduction order per shape). The shapes are the GEMM
misses the runner recorded plus any `--gemm-shape FMT:N:K`; the winners are merged into the
plan file's "gemm" section (its llama.cpp entries are kept), the misses they cover cleared.
`--gemm-interpret` runs the same search under Triton's interpreter on the CPU, with the
buckets' smallest M and three candidates: a functional check for tests, not a measurement.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from . import config, flags
from .compute_settings import LlamaCppSettings
from .tune_score import (CHUNK_TOKENS, DECODE_TOKENS, Measurement, candidates, choose, depth_ranges, render_choices,
                         wait_entry)

ROPE_FIELDS = frozenset({"rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx",
                         "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="measure llama.cpp settings on this machine and write the tuned plan",
                       description="Measure threads, micro-batch size and flash attention with the "
                                   "embedded or given model at several depths, through llama.cpp directly, then "
                                   "how the winner's threads should wait (--thread-wait auto); write the "
                                   "winners as the tuned plan the engine reads at start.")
    p.add_argument("--model", help="GGUF to tune for (default: the embedded model)")
    p.add_argument("--depths", default=None,
                   help="depths to measure, comma-separated (default 512,2048,6144 within --n-ctx, "
                        "plus depths the engine recorded as plan misses)")
    p.add_argument("--n-ctx", type=int, default=config.EngineConfig.n_ctx,
                   help="context per slot of the server to tune for (default 8192)")
    p.add_argument("--n-slots", type=int, default=config.EngineConfig.n_slots,
                   help="slots of the server to tune for (default 4): llama.cpp's kernels are timed "
                        "on the KV pool the server will have")
    # a context past the trained one is measured as it is served: with the same RoPE scaling
    flags.add_arguments(p, config.EngineConfig, only=ROPE_FIELDS)
    p.add_argument("--engines", default="llamacpp",
                   help="llamacpp (default), or llamacpp,torch: time the torch runner beside llama.cpp's "
                        "candidates and write the faster engine for --engine auto")
    p.add_argument("--runs", type=int, default=3, help="repeats per candidate and depth (default 3)")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per measurement (default 32)")
    p.add_argument("--out", help="plan file (default: plan.json in the data directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("GEMM kernels (the torch runner, on a GPU)")
    g.add_argument("--gemm", action="store_true",
                   help="tune the torch runner's GEMM configs on this GPU instead of llama.cpp's settings")
    g.add_argument("--gemm-shape", action="append", default=[], metavar="FMT:N:K",
                   help="a weight shape to tune, e.g. q4_0:4096:11008 (repeatable; the recorded misses are "
                        "tuned too)")
    g.add_argument("--gemm-interpret", action="store_true",
                   help="run the search under Triton's interpreter on the CPU with tiny batches and three "
                        "candidates (a functional check for tests; its timings mean nothing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "gemm", False):
        from .tune_gemm import run_gemm

        return run_gemm(args)
    from .bench.raw import RawError
    from .engine import plan as plan_mod
    from .errors import ApplianceError
    from .models import file_fingerprint, resolve

    out = Path(args.out).expanduser() if args.out else config.default_data_dir() / "plan.json"
    try:
        if args.engines not in ("llamacpp", "llamacpp,torch"):
            raise ValueError(f"--engines must be llamacpp or llamacpp,torch, not {args.engines!r}")
        ref = resolve(args.model)
        model_key = file_fingerprint(ref.path)
        args.rope_flags, args.rope = rope_of(args, ref.path)
        depths = _depths(args, plan_mod.read_misses(out), model_key)
    except ApplianceError as e:
        print(f"appliance tune: {e.message}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"appliance tune: {e}", file=sys.stderr)
        return 2
    try:
        cands, reuse, runs = _tune(args, ref.path, depths)
    except ApplianceError as e:
        print(f"appliance tune: {e.message}", file=sys.stderr)
        return 1
    except RawError as e:
        print(f"appliance tune: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("appliance tune: interrupted; no plan written", file=sys.stderr)
        return 130
    _write_plan(args, out, ref.path.name, model_key, cands, depths, reuse, runs, plan_mod)
    return 0


def _tune(args: argparse.Namespace, model_path: Path, depths: list[int]) -> tuple[list, list[int], tuple]:
    """(llama.cpp's candidates, each one's exact-reuse chunk, the runs: every measurement, the
    engines' measurements with speculation, the winners' waits), the torch runner's measured as
    candidate len(cands) with --engines llamacpp,torch (else the engines' list is empty)."""
    import psutil

    from .bench import prompt_sets
    from .bench.raw import RawReference

    cores = psutil.cpu_count(logical=False) or 1
    cands = candidates(cores, psutil.cpu_count() or cores)
    ids = _prompt_ids(model_path, max(depths), prompt_sets)
    extra = " and the torch runner" if "torch" in args.engines else ""
    print(f"appliance tune: {model_path.name}, {len(cands)} candidates{extra} x {len(depths)} depths x "
          f"{args.runs} runs", file=sys.stderr)
    reuse = [exact_reuse(model_path, c, args.n_ctx, args.rope_flags) for c in cands]
    workers: list[RawReference] = []
    try:
        measured = _measure(args, model_path, cands, depths, reuse, ids, workers)
        spec = _measure_speculation(args, cands, depths, reuse, measured, ids, workers) if len(workers) > len(cands) else []
        waits = _measure_thread_wait(args, model_path, cands, depths, measured, ids, workers)
        return cands, reuse, (measured, spec, waits)
    finally:
        for w in workers:
            w.close()


def rope_of(args: argparse.Namespace, model_path: Path) -> tuple[dict[str, Any], Any]:
    """(the RoPE flags given, as EngineConfig fields; the rotation `serve` would use with them at
    --n-ctx), checked as serve checks them: ValueError with the flag to give."""
    from .fit.model import from_gguf
    from .rope import resolve

    given = flags.values_of(config.EngineConfig, {k: getattr(args, k, None) for k in ROPE_FIELDS}, {})
    cfg = config.EngineConfig(n_ctx=args.n_ctx, **given)        # its __post_init__ checks the flags alone
    return given, resolve(cfg, from_gguf(model_path).positions, args.n_ctx)


def _depths(args: argparse.Namespace, misses: list[dict], model_key: str) -> list[int]:
    """The depths to measure: --depths, else the defaults and the depths the engine recorded as
    this model's plan misses; only those that leave room for --tokens within --n-ctx. ValueError
    when there is nothing to measure."""
    missed = sorted({int(m["depth"]) for m in misses
                     if m.get("model") == model_key and isinstance(m.get("depth"), int)})
    try:
        wanted = ([int(d) for d in args.depths.split(",") if d.strip()] if args.depths
                  else [512, 2048, 6144] + missed)
    except ValueError:
        raise ValueError(f"--depths must be comma-separated integers, got {args.depths!r}") from None
    depths = sorted({d for d in wanted if 0 < d <= args.n_ctx - args.tokens})
    if not depths or args.runs < 1 or args.tokens < 2 or args.n_slots < 1:
        raise ValueError("nothing to measure (depths within --n-ctx, --runs >= 1, --tokens >= 2)")
    return depths


def _measure(args: argparse.Namespace, model_path: Path, cands: Sequence[LlamaCppSettings], depths: list[int],
             reuse: list[int], ids: list[int], workers: list[Any]) -> list[Measurement]:
    """Every candidate at every depth, --runs times, alternated inside each repeat; each worker
    it starts is appended to `workers`, for the caller to close."""
    from tqdm import tqdm

    from .bench.raw import RawReference, RawSettings
    from .engine.grid import Grid

    for c in cands:
        # the server's pool shape (n_slots x n_ctx, not unified): the kernels are timed on
        # the KV pool they will run on
        workers.append(RawReference(str(model_path), RawSettings(
            n_ctx=args.n_ctx, n_slots=args.n_slots, llamacpp=c, grid=Grid(CHUNK_TOKENS), rope=args.rope)))
    if "torch" in args.engines:   # the torch runner: one more "candidate", alternated with the others
        workers.append(RawReference(str(model_path), RawSettings(
            n_ctx=args.n_ctx, n_slots=args.n_slots, llamacpp=cands[0], grid=Grid(CHUNK_TOKENS), rope=args.rope,
            engine="torch", engine_flags=tuple(sorted(args.rope_flags.items())))))
        reuse = [*reuse, 1]
    measured: list[Measurement] = []
    steps = [(r, d, i) for r in range(args.runs) for d in depths for i in range(len(workers))]
    for r, d, i in tqdm(steps, disable=args.quiet, file=sys.stderr, unit="run", leave=False):
        res = workers[i].run([ids[:d]], args.tokens)
        measured.append(Measurement(i, d, 1000.0 * d / res.ttft_ms[0], res.decode_tps, grid_reuse=reuse[i] == 0))
    return measured


def _measure_speculation(args: argparse.Namespace, cands: Sequence[LlamaCppSettings], depths: list[int],
                         reuse: list[int], measured: list[Measurement], ids: list[int],
                         workers: list[Any]) -> list[tuple[Measurement, dict]]:
    """The engines as each would serve: llama.cpp's winner at each depth and the torch runner,
    decoding with the speculation `serve --speculate auto` runs on each (prompt lookup where the
    start-up check proves a verify exact on it, else none; raw_run.speculative_run), alternated
    inside every repeat, over DECODE_TOKENS (the tokens the score weighs; a request's drafting
    record starts at a prior and learns the text's acceptance as it goes, so a short run would
    time the prior). Each measurement with its speculation account."""
    from tqdm import tqdm

    winners = {d: choose(cands, measured, d)[0] for d in depths}
    out: list[tuple[Measurement, dict]] = []
    steps = [(r, d, i) for r in range(args.runs) for d in depths for i in (winners[d], len(cands))]
    for r, d, i in tqdm(steps, disable=args.quiet, file=sys.stderr, unit="run", leave=False):
        n = max(args.tokens, min(DECODE_TOKENS, args.n_ctx - d - 16))   # what the context leaves room for
        res = workers[i].run([ids[:d]], n, speculate=True)
        out.append((Measurement(i, d, 1000.0 * d / res.ttft_ms[0], res.decode_tps,
                                grid_reuse=i < len(cands) and reuse[i] == 0), res.speculation or {}))
    return out


def _measure_thread_wait(args: argparse.Namespace, model_path: Path, cands: Sequence[LlamaCppSettings],
                         depths: list[int], measured: list[Measurement], ids: list[int],
                         workers: list[Any]) -> list[tuple[str, Measurement]]:
    """llama.cpp's winner at each depth with its threads waiting passively (sleeping at once:
    the good neighbour) against spinning (as every candidate was timed), alternated in every
    repeat, for `--thread-wait auto` (engine_choice.thread_wait). Each: (wait, measurement)."""
    from tqdm import tqdm

    from .bench.raw import RawReference, RawSettings
    from .engine.grid import Grid

    winners = {d: choose(cands, measured, d)[0] for d in depths}
    passive = {}
    for i in sorted(set(winners.values())):
        passive[i] = RawReference(str(model_path), RawSettings(
            n_ctx=args.n_ctx, n_slots=args.n_slots, llamacpp=cands[i], grid=Grid(CHUNK_TOKENS), rope=args.rope,
            thread_wait="passive"))
        workers.append(passive[i])
    out = []
    steps = [(r, d, w) for r in range(args.runs) for d in depths for w in ("spin", "passive")]
    for r, d, wait in tqdm(steps, disable=args.quiet, file=sys.stderr, unit="run", leave=False):
        res = (workers[winners[d]] if wait == "spin" else passive[winners[d]]).run([ids[:d]], args.tokens)
        out.append((wait, Measurement(winners[d], d, 1000.0 * d / res.ttft_ms[0], res.decode_tps)))
    return out


def _write_plan(args: argparse.Namespace, out: Path, model_name: str, model_key: str,
                cands: Sequence[LlamaCppSettings], depths: list[int], reuse: list[int],
                runs: tuple[list[Measurement], list[tuple[Measurement, dict]], list[tuple[str, Measurement]]],
                plan_mod: Any) -> None:
    """The winner at each depth into this model's entries of the plan file; its misses cleared."""
    measured, spec, waits = runs
    entries, table = [], []
    for d, depth_max in zip(depths, depth_ranges(depths)):
        winner, medians = choose(cands, measured, d)
        for i in medians:
            medians[i]["min_chunk"] = reuse[i]
        entries.append(plan_mod.LlamaCppChoice(depth_max=depth_max, settings=cands[winner], measured={
            "depth": d, "n_ctx": args.n_ctx, "n_slots": args.n_slots, "rope": args.rope.as_dict(),
            **{str(i): m for i, m in medians.items()}}))
        table += [(d, i, cands[i], m, i == winner) for i, m in medians.items()]
    engine, engine_table = _engine_entry(cands, spec, depths, table, model_name)
    wait, wait_table = wait_entry(waits, depths, model_name)
    fingerprint = plan_mod.current_fingerprint(_build_info())
    plan = _merged(out, fingerprint, model_key, tuple(entries), plan_mod, engine, wait)
    plan_mod.save(plan, out)
    plan_mod.clear_misses(out, model_key)
    print(render_choices(model_name, table))
    if engine_table:
        print(engine_table)
    if wait_table:
        print(wait_table)
    print(f"wrote {out} (plan {plan.hash}); `appliance serve` reads it at start")


def _engine_entry(cands: Sequence[LlamaCppSettings], spec: list[tuple[Measurement, dict]], depths: list[int],
                  table: list, model_name: str) -> tuple[dict | None, str]:
    """The plan's engines entry for this model and the table tune prints, from the engines
    measured as each serves (`_measure_speculation`); (None, "") when the torch runner was not."""
    from .engine_choice import as_served, choose_engine, render

    won = {d: i for d, i, _, _, w in table if w}
    torch_at = {d: m for d in depths if (m := as_served(spec, len(cands), d))}
    llama_at = {d: m for d in depths if d in won and (m := as_served(spec, won[d], d))}
    if not torch_at:
        return None, ""
    chosen, why = choose_engine({"llamacpp": {d: m["score_s"] for d, m in llama_at.items()},
                                 "torch": {d: m["score_s"] for d, m in torch_at.items()}})
    rows = [(d, e, at[d]) for d in depths for e, at in (("llamacpp", llama_at), ("torch", torch_at)) if d in at]
    entry = {"engine": chosen, "why": why, "measured": {str(d): {"llamacpp": llama_at[d], "torch": torch_at[d]}
                                                       for d in depths if d in llama_at and d in torch_at}}
    return entry, render(model_name, rows, chosen, why)


def exact_reuse(model_path: Path, c: LlamaCppSettings, n_ctx: int, rope_flags: dict[str, Any] | None = None) -> int:
    """The engine's chunk-invariance check on this candidate (one slot of the server's context):
    the smallest chunk that computes as the grid's, 0 when the cache may reuse whole blocks only."""
    from .engine.cache.invariance import check_chunk_invariance, probe_prompt
    from .engine.runners.llamacpp import LlamaCppRunner

    cfg = config.EngineConfig(plan="off", n_slots=1, n_ctx=n_ctx, prefill_chunk=CHUNK_TOKENS,
                              **(rope_flags or {})).with_llamacpp(c)
    runner = LlamaCppRunner(cfg, model_path, "tune")
    try:
        return check_chunk_invariance(runner, 0, probe_prompt(runner, CHUNK_TOKENS), CHUNK_TOKENS).min_chunk
    finally:
        runner.close()


def _build_info() -> str:
    from .engine.plan import llama_cpp_build

    return llama_cpp_build()


def _prompt_ids(model_path: Path, n: int, prompt_sets: Any) -> list[int]:
    """n token ids of filler prose, tokenized by the model's own vocabulary (loaded alone)."""
    import llama_cpp as L

    from .bench.raw import quiet_llama_log

    quiet_llama_log()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(model_path).encode(), params)
    try:
        vocab = L.llama_model_get_vocab(model)
        chars = n * 8 + 64
        while True:
            data = prompt_sets.filler(chars, seed=0).encode()
            buf = (L.llama_token * (len(data) + 16))()
            got = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
            if got >= n:
                return list(buf[:n])
            chars *= 2
    finally:
        L.llama_model_free(model)


def _merged(out: Path, fingerprint: dict[str, str], model_key: str, entries: tuple, plan_mod: Any,
            engine: dict | None = None, wait: dict | None = None) -> Any:
    """This model's entries (and engine choice, when measured) in the existing plan when it was
    made here, else a new plan. The gemm section is kept either way: it is judged by its own
    fingerprint."""
    others: dict[str, tuple] = {}
    engines: dict[str, Any] = {}
    waits: dict[str, Any] = {}
    gemm = None
    try:
        old = plan_mod.read(out) if out.exists() else None
    except plan_mod.PlanRefused:
        old = None  # a broken plan: replaced whole
    if old is not None:
        gemm = old.gemm
        if not plan_mod.differences(old.fingerprint, fingerprint):
            # else another machine's: dropped
            others, engines, waits = dict(old.llamacpp), dict(old.engines or {}), dict(old.thread_waits or {})
    others[model_key] = entries
    if engine is not None:
        engines[model_key] = engine
    if wait is not None:
        waits[model_key] = wait
    return plan_mod.Plan(fingerprint=fingerprint, llamacpp=others, created_at=_now(), gemm=gemm,
                         engines=engines or None, thread_waits=waits or None)


def _now() -> str:
    from .tune_gemm import _now as now     # one clock for both halves of the plan

    return now()
