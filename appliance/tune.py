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
import dataclasses
import datetime
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from . import config, flags
from .compute_settings import LlamaCppSettings
from .tune_score import CHUNK_TOKENS, NEAR_TIE, Measurement, choose, depth_ranges, render_choices

ROPE_FIELDS = frozenset({"rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx",
                         "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="measure llama.cpp settings on this machine and write the tuned plan",
                       description="Measure threads, micro-batch size and flash attention with the "
                                   "embedded or given model at several depths, through llama.cpp directly; "
                                   "write the winners as the tuned plan the engine reads at start.")
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
        return run_gemm(args)
    import psutil

    from .bench import prompt_sets
    from .bench.raw import RawError, RawReference
    from .engine import plan as plan_mod
    from .errors import ApplianceError
    from .models import file_fingerprint, resolve

    try:
        ref = resolve(args.model)
    except ApplianceError as e:
        print(f"appliance tune: {e.message}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser() if args.out else config.default_data_dir() / "plan.json"
    model_key = file_fingerprint(ref.path)
    try:
        args.rope_flags, args.rope = rope_of(args, ref.path)
    except ValueError as e:
        print(f"appliance tune: {e}", file=sys.stderr)
        return 2
    try:
        depths = _depths(args, plan_mod.read_misses(out), model_key)
    except ValueError as e:
        print(f"appliance tune: {e}", file=sys.stderr)
        return 2
    cores = psutil.cpu_count(logical=False) or 1
    cands = plan_mod.candidates(cores, psutil.cpu_count() or cores)
    ids = _prompt_ids(ref.path, max(depths), prompt_sets)
    print(f"appliance tune: {ref.path.name}, {len(cands)} candidates x {len(depths)} depths x {args.runs} runs",
          file=sys.stderr)
    try:
        reuse = [exact_reuse(ref.path, c, args.n_ctx, args.rope_flags) for c in cands]
    except ApplianceError as e:
        print(f"appliance tune: {e.message}", file=sys.stderr)
        return 1
    workers: list[RawReference] = []
    try:
        measured = _measure(args, ref.path, cands, depths, reuse, ids, workers)
    except RawError as e:
        print(f"appliance tune: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("appliance tune: interrupted; no plan written", file=sys.stderr)
        return 130
    finally:
        for w in workers:
            w.close()
    _write_plan(args, out, ref.path.name, model_key, cands, depths, reuse, measured, plan_mod)
    return 0


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
    measured: list[Measurement] = []
    steps = [(r, d, i) for r in range(args.runs) for d in depths for i in range(len(cands))]
    for r, d, i in tqdm(steps, disable=args.quiet, file=sys.stderr, unit="run", leave=False):
        res = workers[i].run([ids[:d]], args.tokens)
        measured.append(Measurement(i, d, 1000.0 * d / res.ttft_ms[0], res.decode_tps, grid_reuse=reuse[i] == 0))
    return measured


def _write_plan(args: argparse.Namespace, out: Path, model_name: str, model_key: str,
                cands: Sequence[LlamaCppSettings], depths: list[int], reuse: list[int],
                measured: list[Measurement], plan_mod: Any) -> None:
    """The winner at each depth into this model's entries of the plan file; its misses cleared."""
    entries, table = [], []
    for d, depth_max in zip(depths, depth_ranges(depths)):
        winner, medians = choose(cands, measured, d)
        for i in medians:
            medians[i]["min_chunk"] = reuse[i]
        entries.append(plan_mod.LlamaCppChoice(depth_max=depth_max, settings=cands[winner], measured={
            "depth": d, "n_ctx": args.n_ctx, "n_slots": args.n_slots, "rope": args.rope.as_dict(),
            **{str(i): m for i, m in medians.items()}}))
        table += [(d, i, cands[i], m, i == winner) for i, m in medians.items()]
    fingerprint = plan_mod.current_fingerprint(_build_info())
    plan = _merged(out, fingerprint, model_key, tuple(entries), plan_mod)
    plan_mod.save(plan, out)
    plan_mod.clear_misses(out, model_key)
    print(render_choices(model_name, table))
    print(f"wrote {out} (plan {plan.hash}); `appliance serve` reads it at start")


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
    import ctypes

    import llama_cpp as L

    quiet = L.llama_log_callback(lambda *a: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
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


def _merged(out: Path, fingerprint: dict[str, str], model_key: str, entries: tuple, plan_mod: Any) -> Any:
    """This model's entries in the existing plan when it was made here, else a new plan. The
    gemm section is kept either way: it is judged by its own fingerprint."""
    others: dict[str, tuple] = {}
    gemm = None
    try:
        old = plan_mod.read(out) if out.exists() else None
    except plan_mod.PlanRefused:
        old = None  # a broken plan: replaced whole
    if old is not None:
        gemm = old.gemm
        if not plan_mod.differences(old.fingerprint, fingerprint):
            others = dict(old.llamacpp)   # else another machine's entries: dropped
    others[model_key] = entries
    return plan_mod.Plan(fingerprint=fingerprint, llamacpp=others, created_at=_now(), gemm=gemm)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------- tune --gemm

def run_gemm(args: argparse.Namespace) -> int:
    """Search each shape's GEMM configs, merge the winners into the plan, clear the misses."""
    out = Path(args.out).expanduser() if args.out else config.default_data_dir() / "plan.json"
    if args.gemm_interpret:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton is first imported
    device, why = _gemm_device(args.gemm_interpret)
    if why:
        print(f"appliance tune --gemm: {why}", file=sys.stderr)
        return 2
    from kernels import plan as kplan
    from kernels.gemm_trial import candidates

    from .engine import plan as plan_mod

    try:
        shapes = gemm_shapes(out, args.gemm_shape)
    except ValueError as e:
        print(f"appliance tune --gemm: {e}", file=sys.stderr)
        return 2
    if not shapes:
        print(f"appliance tune --gemm: nothing to tune: no --gemm-shape, and {plan_mod.misses_path(out)} records "
              f"no GEMM misses", file=sys.stderr)
        return 2
    small = args.gemm_interpret
    buckets_m = kplan.BUCKET_M_SMALL if small else kplan.BUCKET_M
    print(f"appliance tune --gemm: {len(shapes)} shapes x {len(buckets_m)} buckets on {device}"
          f"{' (interpreter)' if small else ''}", file=sys.stderr)
    results = []
    try:
        for key in shapes:
            res = kplan.search(key.op, key.fmt, key.n, key.k, buckets_m,
                               candidates(key.fmt, small=small), device=device)
            results.append(res)
            _report_dropped(res)
    except KeyboardInterrupt:
        print("appliance tune --gemm: interrupted; no plan written", file=sys.stderr)
        return 130
    fingerprint = kplan.gemm_fingerprint(device)
    plan = _merged_gemm(out, fingerprint, {r.key: r.entries for r in results}, plan_mod, kplan)
    plan_mod.save(plan, out)
    plan_mod.clear_gemm_misses(out, [r.key.miss(b) for r in results for b in r.entries])
    print(_render_gemm(results, buckets_m, fingerprint, small))
    print(f"wrote {out} (plan {plan.hash}); the torch runner reads its GEMM entries at start")
    return 0 if all(r.entries for r in results) else 1


def _gemm_device(interpret: bool) -> tuple[str | None, str | None]:
    """Where the search runs ("cuda", or "cpu" under the interpreter), or why it cannot."""
    try:
        import torch

        from kernels._triton import INTERPRET, available
    except ImportError as e:
        return None, f"needs torch and Triton (pip install 'appliance[torch]'): {e}"
    if interpret:
        if not INTERPRET or not available("cpu"):
            return None, "--gemm-interpret needs Triton, imported with TRITON_INTERPRET=1"
        return "cpu", None
    if INTERPRET:
        return None, ("TRITON_INTERPRET=1 is set, so the kernels would run interpreted on the CPU: unset it "
                      "to tune on the GPU, or pass --gemm-interpret for a functional run")
    if not torch.cuda.is_available() or not available("cuda"):
        return None, ("GEMM configs are measured on the GPU that will serve, and torch sees no CUDA device "
                      f"here (torch {torch.__version__}); --gemm-interpret runs the search under Triton's "
                      "interpreter instead (tests)")
    return "cuda", None


def gemm_shapes(out: Path, specs: Sequence[str]) -> list:
    """The keys to tune: each --gemm-shape FMT:N:K, then each shape the runner recorded as a
    GEMM miss beside the plan `out`, once each, in that order."""
    from kernels.plan import GemmKey

    from .engine import plan as plan_mod

    keys = []
    for spec in specs:
        try:
            fmt, n, k = spec.split(":")
            keys.append(GemmKey.of("wgemm", fmt, int(n), int(k)))
        except ValueError as e:
            raise ValueError(f"--gemm-shape must be FMT:N:K (e.g. q4_0:4096:4096); {spec!r}: {e}") from None
    for m in plan_mod.gemm_misses(out):
        try:
            keys.append(GemmKey.of(m["op"], m["fmt"], m["n"], m["k"]))
        except (KeyError, ValueError):
            continue  # a miss of an op or format this build does not tune
    return list(dict.fromkeys(keys))


def _merged_gemm(out: Path, fingerprint: dict[str, str], found: dict, plan_mod: Any, kplan: Any) -> Any:
    """The plan file with `found` merged into its GEMM entries: kept when they were measured
    under this fingerprint, else replaced; the llama.cpp part is kept as it is (a new file gets
    this machine's llama.cpp fingerprint and no llama.cpp entries)."""
    try:
        old = plan_mod.read(out) if out.exists() else None
    except plan_mod.PlanRefused as e:
        print(f"appliance tune --gemm: replacing an unreadable plan: {e}", file=sys.stderr)
        old = None
    table = kplan.GemmTable(fingerprint)
    if old is not None and old.gemm is not None:
        try:
            table = plan_mod.gemm_table(old, fingerprint, str(out))
        except plan_mod.PlanRefused as e:
            print(f"appliance tune --gemm: dropping the old GEMM entries: {e}", file=sys.stderr)
    gemm = table.merged(found).to_json()
    if old is not None:
        return dataclasses.replace(old, created_at=_now(), gemm=gemm)
    return plan_mod.Plan(fingerprint=_llama_fingerprint(plan_mod), llamacpp={}, created_at=_now(), gemm=gemm)


def _llama_fingerprint(plan_mod: Any) -> dict[str, str]:
    try:
        return plan_mod.current_fingerprint(_build_info())
    except (ImportError, OSError, AttributeError):
        return plan_mod.current_fingerprint("")


def _report_dropped(res: Any) -> None:
    """One stderr line per shape: how many candidates were timed and dropped, and why."""
    reasons: dict[str, int] = {}
    for d in res.dropped:
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
    why = "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
    print(f"  {res.key.label}: {len(res.timed)} timed, {len(res.dropped)} dropped{': ' + why if why else ''}"
          f"{'' if res.entries else ' -- no candidate passed, the shape stays a miss'}", file=sys.stderr)


def _render_gemm(results: Sequence[Any], buckets_m: dict[str, int], fingerprint: dict[str, str], small: bool) -> str:
    from kernels.wgemm import bytes_moved

    lines = [f"## Tuned GEMM configs on {fingerprint['device']} ({fingerprint['runtime']})", "",
             "each checked against the reference before it was timed; median of the repeats at the bucket's M; "
             f"near-ties within {NEAR_TIE:.0%} go to the earlier candidate"
             + (" (interpreter: the times say nothing about speed)" if small else ""), "",
             "| shape | bucket | M | block m/n/k | split k | warps | stages | dot | median us | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for b, e in r.entries.items():
            c, m = e.config, buckets_m[b]
            x_bytes = 4 if small or c.dot == "fp32" else 2
            gb_s = bytes_moved(m, r.key.n, r.key.k, r.key.fmt, x_bytes) / (e.median_us * 1e-6) / 1e9 if e.median_us else 0.0
            lines.append(f"| {r.key.fmt}:{r.key.n}:{r.key.k} | {b} | {m} | {c.block_m}/{c.block_n}/{c.block_k} | "
                         f"{c.split_k} | {c.num_warps} | {c.num_stages} | {c.dot} | {e.median_us:,.1f} | {gb_s:.3g} |")
    return "\n".join(lines) + "\n"
