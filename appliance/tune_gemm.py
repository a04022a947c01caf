"""`appliance tune --gemm`: the torch runner's GEMM configurations measured on the GPU that will
serve (`kernels.plan`: each candidate checked against the reference before it is timed, per
shape and batch bucket, one reduction order per shape), merged into the plan file's "gemm"
section (its llama.cpp entries are kept), the misses they cover cleared. `--gemm-interpret` runs
the same search under Triton's interpreter on the CPU: a functional check for tests."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from . import config
from .tune_score import NEAR_TIE


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _build_info() -> str:
    from .engine.plan import llama_cpp_build

    return llama_cpp_build()


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
