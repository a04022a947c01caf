"""`appliance sweep`, `appliance bench` and `appliance results`: their arguments, and each
command's checks before it hands a plan to the driver (driver.py) or reads the store."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import config
from ..flags import add_arguments
from ..store import Store
from .driver import claim, drive, drive_soak, fail

EPILOG_SETTINGS = ("Engine flags (--n-ctx, --n-slots, --flash-attn, ...) are those of `appliance serve` "
                   "and configure the server the command starts; with --url they are ignored and the "
                   "server's own settings are recorded.")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _watts(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated watts, got {text!r}") from None
    if not values or any(not v > 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive watts, got {text!r}")
    return values


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="measure the server at this address instead of starting one")
    p.add_argument("--api-key", help="bearer key for --url")
    p.add_argument("--runs", type=int, default=3, help="repeats of every cell (default 3)")
    p.add_argument("--ab", nargs=2, metavar=("SETTINGS_A", "SETTINGS_B"),
                   help="start two servers with these extra serve flags (quoted, e.g. '--flash-attn' "
                        "'--no-flash-attn') and alternate A B A B; stores both and the pairwise ratios")
    p.add_argument("--against", metavar="URL",
                   help="measure the server at URL (llama-server, another appliance) side by side with "
                        "this one (the server the bench starts, or --url): A is this one, B that one; cells "
                        "alternate A B, the agent replay turn by turn, and each waits until its server has "
                        "no idle work left; stores both and the pairwise ratios")
    p.add_argument("--no-raw", action="store_true",
                   help="skip the raw llama.cpp reference rows")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--idle-seconds", type=float, default=1.0, metavar="S",
                   help="seconds of idle power measured before the first cell, so energy is reported "
                        "gross and above idle (default 1; 0 skips)")
    p.add_argument("--power-cap", type=_watts, default=(), metavar="W1,W2,...",
                   help="power envelopes in watts, each cell measured under each, alternated: the GPU's cap "
                        "(NVIDIA power limit, amdgpu power1_cap), else RAPL's long-term package limit; needs "
                        "root, and the original cap is restored however the run ends")
    add_arguments(p, config.EngineConfig, config.StoreConfig)


def add_parsers(sub: Any) -> None:
    _add_sweep(sub)
    _add_bench(sub)
    _add_results(sub)


def _add_sweep(sub: Any) -> None:
    sweep = sub.add_parser(
        "sweep", help="TTFT, prefill and decode rate by prompt size, served and raw",
        description="For each prompt size: TTFT, prefill rate, then client and engine decode rate at "
                    "that depth, through the HTTP API as a streaming client, beside the same model driven "
                    "in-process through llama.cpp (the raw row). Every prompt starts with a fresh nonce, "
                    "so no cache serves it.", epilog=EPILOG_SETTINGS)
    sweep.add_argument("-p", "--prompt-sizes", type=_ints, default=(512, 2048, 8192),
                       help="prompt sizes in tokens (default 512,2048,8192)")
    sweep.add_argument("-n", "--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    sweep.add_argument("--cache", choices=("on", "off"), default="off",
                       help="on: also resend each prompt and measure it served from the prompt cache")
    _common(sweep)
    sweep.set_defaults(func=run_sweep)


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="the workloads users run: prompt sets by kind, depth, concurrency, agent replay, needle",
        description="Named prompt sets by kind of text, a long-context row, 1/2/4 concurrent streams "
                    "(per stream and aggregate), a replayed agent conversation (first-turn and follow-up "
                    "TTFT, share of prompt served from cache) and a needle check up to the context limit.",
        epilog=EPILOG_SETTINGS)
    bench.add_argument("--modes", type=_names, default=("serial",), help="decoding modes (default serial)")
    bench.add_argument("--prompts", type=_names, default=None,
                       help="prompt sets (default: all shipped sets; '' for none; see --list-prompts)")
    bench.add_argument("--list-prompts", action="store_true", help="list the shipped prompt sets and exit")
    bench.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    bench.add_argument("--depths", type=_ints, default=(), help="long-context rows at these depths "
                       "(default: half the server's context)")
    bench.add_argument("--no-depth", action="store_true", help="skip the long-context rows")
    bench.add_argument("--concurrency", type=_ints, default=(1, 2, 4),
                       help="stream counts (default 1,2,4; '' for none)")
    bench.add_argument("--agent-conversations", type=int, default=1,
                       help="agent conversations replayed interleaved (0 = no agent replay)")
    bench.add_argument("--agent-turns", type=int, default=8, help="turns per agent conversation")
    bench.add_argument("--agent-system-tokens", type=int, default=2000, help="agent system prompt size")
    bench.add_argument("--agent-turn-tokens", type=int, default=300, help="tool result size per turn")
    bench.add_argument("--agent-tools", type=int, default=None, metavar="N",
                       help="tool definitions the agent sends: the first N of the tool-calls set's read_file, "
                            "write_file, edit_file, run_shell, search_code, list_directory (default: all six, "
                            "~700 tokens; 1 sends read_file alone, ~130)")
    bench.add_argument("--agent-tool-ms", type=int, default=0, metavar="MS",
                       help="how long each tool call takes: the client waits this long before each follow-up "
                            "turn, and the server is idle meanwhile (default 0: turns back to back)")
    bench.add_argument("--agent-restart", action="store_true",
                       help="after the replay, restart the server and measure each conversation's next turn "
                            "(restored from the prompt cache's disk tier)")
    bench.add_argument("--restart-command", default=None, metavar="CMD",
                       help="with --url and --agent-restart: a shell command that restarts that server "
                            "(the bench then waits until its /v1/models answers)")
    bench.add_argument("--against-restart-command", default=None, metavar="CMD",
                       help="with --against and --agent-restart: a shell command that restarts that server")
    bench.add_argument("--needle-lengths", type=_ints, default=None,
                       help="needle prompt lengths (default: 1/4, 1/2, 0.9 of the context and one over it)")
    bench.add_argument("--no-needle", action="store_true", help="skip the needle check")
    bench.add_argument("--soak", type=_minutes, metavar="MINUTES",
                       help="instead of the workloads: a soak of this many minutes, mixed requests (chat, "
                            "streamed, tools, structured output, cancelled streams, over-context, bad bodies) "
                            "from several clients; reports requests by status, TTFT p50/p99, and the server's "
                            "and engine's RSS and open fds from /metrics; exits 1 on a failure or suspected leak")
    bench.add_argument("--soak-clients", type=int, default=4, help="client threads of --soak (default 4)")
    _common(bench)
    bench.set_defaults(func=run_bench)


def _add_results(sub: Any) -> None:
    results = sub.add_parser("results", help="list stored runs, show one, compare two, plot, estimate a job",
                             description="Read the result store that bench and sweep write.")
    results.add_argument("run", nargs="?", type=int, help="the run to show (default: the list of runs)")
    results.add_argument("--last", action="store_true", help="show the last run")
    results.add_argument("--format", choices=("md", "json", "csv"), default="md")
    results.add_argument("--compare", nargs=2, type=int, metavar=("RUN_A", "RUN_B"),
                         help="pairwise ratios B/A of two runs' matching cells")
    results.add_argument("--plot", metavar="FILE.png", help="decode and prefill against depth, one line per run "
                         "(the runs given with --runs-to-plot, default the last run)")
    results.add_argument("--plot-runs", type=_ints, default=None, help="runs to plot (default: the last run)")
    results.add_argument("--estimate", nargs=2, type=int, metavar=("PROMPT_TOKENS", "OUTPUT_TOKENS"),
                         help="how long a job takes, from a run's stored curves (default: the last sweep)")
    add_arguments(results, config.StoreConfig)
    results.set_defaults(func=run_results)


def run_sweep(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from .plans import sweep_plan

    if args.tokens < 2:
        return fail("sweep", "-n must be at least 2 (a decode rate needs two tokens)")
    need = max(args.prompt_sizes) + args.tokens
    try:
        configured = config.load(vars(args)).engine.n_ctx
    except (ValueError, TypeError) as e:
        return fail("sweep", str(e))
    if not args.url and args.n_ctx is None and configured and need > configured:
        # the server this sweep starts gets the context its largest cell needs
        args.n_ctx = -(-need // 256) * 256
        print(f"appliance sweep: serving with --n-ctx {args.n_ctx} for the {max(args.prompt_sizes)}-token "
              f"prompt and {args.tokens} generated tokens", file=sys.stderr)
    return drive("sweep", args, argv, lambda ctx: sweep_plan(ctx, args.prompt_sizes, args.tokens, args.runs,
                                                            args.cache == "on"))


def run_bench(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from . import prompt_sets
    from .context import BenchOptions
    from .plans import bench_plan

    if args.list_prompts:
        for name in prompt_sets.names():
            ps = prompt_sets.load(name)
            print(f"{name:16} {len(ps.prompts)} prompts  {ps.description}")
        return 0
    if args.soak is not None:
        return run_soak(args, argv)
    if args.tokens < 2:
        return fail("bench", "--tokens must be at least 2 (a decode rate needs two tokens)")
    if args.agent_tools is not None and args.agent_tools < 1:
        return fail("bench", "--agent-tools must be at least 1 (the agent's turns call read_file)")
    try:
        sets = args.prompts if args.prompts is not None else prompt_sets.DEFAULT_SETS
        for name in sets:
            prompt_sets.load(name)
    except prompt_sets.UnknownPromptSet as e:
        return fail("bench", str(e))
    options = BenchOptions(modes=args.modes, prompt_sets=tuple(sets), tokens=args.tokens, runs=args.runs,
                           depths=None if args.no_depth else args.depths, concurrency=args.concurrency,
                           agent_conversations=args.agent_conversations, agent_turns=args.agent_turns,
                           agent_system_tokens=args.agent_system_tokens, agent_tools=args.agent_tools,
                           agent_turn_tokens=args.agent_turn_tokens, agent_restart=args.agent_restart,
                           agent_tool_ms=args.agent_tool_ms,
                           needle_lengths=() if args.no_needle else args.needle_lengths)
    return drive("bench", args, argv, lambda ctx: bench_plan(ctx, options))


def run_soak(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """`bench --soak MINUTES`: the server it starts (or --url's) under mixed load, stored as a
    run of kind "soak" (soakreport.py says how); 0 only when the verdict is PASS."""
    from ..errors import ApplianceError

    if args.soak_clients < 1:
        return fail("bench", "--soak-clients must be at least 1")
    if args.ab or args.against:
        return fail("bench", "--soak measures one server; it cannot be used with --ab or --against")
    if args.power_cap:
        return fail("bench", "--soak runs under the host's own power cap; --power-cap is for the measured cells")
    try:
        cfg = config.load(vars(args))
        claimed, _, file_fp = claim("bench", args, cfg)
    except (ValueError, TypeError) as e:
        return fail("bench", str(e))
    except ApplianceError as e:
        return fail("bench", e.message)
    from .client import BenchError

    try:
        return drive_soak(args, argv, cfg, claimed, file_fp)
    except BenchError as e:
        return fail("bench", str(e))


def run_results(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from . import report, results
    from ..store import UnknownRun

    cfg = config.load(vars(args))
    db_path = cfg.store.resolved_db_path()
    if not Path(db_path).exists():
        return fail("results", f"no results yet: {db_path} does not exist (run `appliance sweep` or "
                                "`appliance bench` first)")
    with Store.open(db_path) as store:
        try:
            return _results(args, store, results, report)
        except UnknownRun as e:
            return fail("results", str(e))
        except ValueError as e:
            return fail("results", str(e))


def _results(args: argparse.Namespace, store: Store, results: Any, report: Any) -> int:
    last = store.last_run()
    if args.compare:
        a, b = args.compare
        print(report.render_compare(results.compare(store.results(a), store.results(b),
                                                     f"run {a}", f"run {b}"), f"run {a}", f"run {b}"))
        return 0
    if args.estimate:
        print(results.render_estimate(results.estimate_from_store(store, *args.estimate, run_id=args.run)))
        return 0
    if args.plot:
        ids = args.plot_runs or ((args.run,) if args.run else ((last.id,) if last else ()))
        if not ids:
            return fail("results", "no runs to plot")
        results.plot([(store.run(i), store.results(i)) for i in ids], args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.run or args.last:
        run_id = args.run or (last.id if last else None)
        if run_id is None:
            return fail("results", "no runs stored yet")
        print(report.render_run(store.run(run_id), store.host(run_id), store.results(run_id), args.format))
        return 0
    print(report.render_runs(store.runs(), report.cell_counts(store)))
    return 0
