"""The `appliance` command: a small dispatcher, each subcommand importing what it needs lazily."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys

from . import __version__, config, flags


def _serve(args: argparse.Namespace) -> int:
    from appliance.errors import ApplianceError

    try:
        cfg = config.load(vars(args))
    except (ValueError, TypeError) as e:
        print(f"appliance serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.server.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for note in cfg.adjusted:      # found before logging was set up
        logging.getLogger("appliance.config").info("%s", note)
    from appliance.models import resolve

    try:   # a model that is not there is said at once, before the server starts (the pool logs its path)
        ref = resolve(cfg.engine.model, cfg.engine.model_alias)
    except ApplianceError as e:
        print(f"appliance serve: {e.message}", file=sys.stderr)
        return 2
    try:   # and a context it cannot be served at, before anything loads
        _check_context(cfg.engine, ref.path)
    except ValueError as e:
        print(f"appliance serve: {ref.path.name}: {e}", file=sys.stderr)
        return 2
    from web.server import serve  # the only place the core reaches the web layer

    return serve(cfg)


def _check_context(cfg: config.EngineConfig, path) -> None:
    """The served context and its RoPE scaling resolved from a GGUF's header (ValueError with the
    flag to give); a checkpoint directory is checked by the torch runner as it loads."""
    if path.is_dir():
        return
    from .fit.auto import for_file as auto_n_ctx
    from .fit.gguf_header import read_header
    from .rope import AUTO_N_CTX, ModelRope, served

    try:
        meta, _ = read_header(path)
    except (ValueError, OSError) as e:   # not a GGUF it can read: the load refuses it, naming
        if cfg.n_ctx == AUTO_N_CTX:      # the file with llama.cpp's own reason
            raise ValueError(f"--n-ctx auto cannot size a file that is not a readable GGUF ({e})") from None
        return
    if cfg.n_ctx == AUTO_N_CTX:    # the catalog resolves it the same way (cached) and logs it
        cfg = dataclasses.replace(cfg, n_ctx=auto_n_ctx(cfg, path)[0])
    served(cfg, ModelRope.from_meta(meta.get, str(meta.get("general.architecture", ""))))


def _hostcheck(args: argparse.Namespace) -> int:
    import json

    from hostcheck import as_json, check, collect, render
    from hostcheck.advice import model_bytes_of

    model_bytes = args.model_bytes
    if args.model is not None:
        try:
            model_bytes = model_bytes_of(args.model)
        except OSError as e:
            print(f"appliance hostcheck: cannot read --model {args.model}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    workers = {}
    if args.rpc:
        from .endpoints import parse_endpoints
        from .worker_facts import fetch_all

        try:
            workers = fetch_all(list(parse_endpoints(args.rpc)), facts_port=args.facts_port)
        except ValueError as e:
            print(f"appliance hostcheck: {e}", file=sys.stderr)
            return 2
    snap = collect()
    llama = _llama_build()
    advice = check(snap, model_bytes=model_bytes, llama=llama)
    checks = _device_checks()
    if args.json:
        print(json.dumps({**as_json(snap, advice, llama), "device_checks": [v.report("remembered") for v in checks],
                          **({"workers": workers} if args.rpc else {})}, indent=2))
    else:
        print(render(snap, advice, llama), end="")
        print("\n== device checks remembered (appliance check MODEL runs one) ==\n" + "".join(
            f"{v.model_sha256[:12]}: {v.describe()}; {v.build}, driver {v.driver}\n" for v in checks)
            if checks else "\n== device checks: none remembered (appliance check MODEL runs one) ==\n", end="")
        for ep, facts in workers.items():
            print(f"\n== RPC worker {ep} ==\n"
                  + facts.get("text", f"its facts are unavailable: {facts.get('error')}\n"), end="")
    return 0 if all("error" not in f for f in workers.values()) else 1


def _device_checks() -> list:
    """The device check's remembered verdicts (engine/device_check.py), newest first."""
    from .engine.device_check import VerdictCache

    return VerdictCache().all()


def _llama_build():
    """What the installed llama.cpp can drive, for hostcheck's advice (None if it cannot load)."""
    try:
        from .engine.runners.ggml_devices import llama_build

        return llama_build()
    except (ImportError, OSError, AttributeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A local LLM serving appliance.")
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the chat page and the OpenAI-compatible API",
                           description="Serve a GGUF model (default: the embedded SmolLM2-135M-Instruct) "
                                       "with a chat page at / and an OpenAI-compatible API at /v1. "
                                       "Every flag can also be set by its APPLIANCE_* environment "
                                       "variable; flags win.")
    flags.add_arguments(serve, config.EngineConfig, config.ServerConfig)
    serve.set_defaults(func=_serve)
    host = sub.add_parser("hostcheck", help="report the host settings that change measured speed",
                          description="Read the CPU, memory, kernel command line, IOMMU, GPUs and "
                                      "power limits from /proc, /sys and nvidia-smi, and warn "
                                      "about settings known to cost performance. Facts the host "
                                      "does not expose are reported as unavailable, with the "
                                      "reason.")
    host.add_argument("--json", action="store_true", help="print the snapshot and advice as JSON")
    host.add_argument("--rpc", metavar="HOST:PORT[,...]",
                      help="also report these `appliance worker`s' hosts (each answers on its next port); "
                           "exit status 1 when one does not answer")
    host.add_argument("--facts-port", type=int, metavar="PORT",
                      help="with --rpc: ask the workers for their facts on this port, for workers started "
                           "with `appliance worker --facts-port PORT` (default: each one's RPC port + 1)")
    size = host.add_mutually_exclusive_group()
    size.add_argument("--model", metavar="PATH",
                      help="check that this model fits (GTT, VRAM, memory) by its size on disk")
    size.add_argument("--model-bytes", type=int, metavar="N",
                      help="check that a model of N bytes fits")
    host.set_defaults(func=_hostcheck)
    from .bench.commands import add_parsers  # argparse only; the measuring code loads when run
    from .check_command import add_parser as add_check
    from .fit.command import add_parser as add_fit
    from .library.command import add_parsers as add_library
    from .quantize import add_parser as add_quantize
    from .template_command import add_parser as add_template
    from .tune import add_parser as add_tune
    from .worker import add_parser as add_worker

    add_parsers(sub)
    add_tune(sub)
    add_fit(sub)
    add_check(sub)
    add_library(sub)
    add_quantize(sub)
    add_worker(sub)
    add_template(sub)
    return parser


# the commands a user stops with Ctrl-C, keeping what they finished
INTERRUPTIBLE = ("bench", "sweep", "tune", "pull")


def _honour_ctrl_c() -> None:
    """Ctrl-C (SIGINT) stops the command even when its parent left SIGINT ignored, as a
    non-interactive shell does for `cmd &`, and nohup and some CI harnesses do: Python keeps an
    inherited SIG_IGN, and the command would run to its end and exit 0."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    func, command = args.func, args.command
    del args.func, args.command
    if command in INTERRUPTIBLE:
        _honour_ctrl_c()
    if command in ("bench", "sweep"):
        return func(args, argv[1:])  # the stored run keeps its command line
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
