"""The `appliance` command: a small dispatcher, each subcommand importing what it needs lazily."""
from __future__ import annotations

import argparse
import logging
import sys

from . import __version__, config


def _serve(args: argparse.Namespace) -> int:
    from appliance.errors import ApplianceError

    try:
        cfg = config.load(vars(args))
    except (ValueError, TypeError) as e:
        print(f"appliance serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.server.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from appliance.models import resolve

    try:
        ref = resolve(cfg.engine.model, cfg.engine.model_alias)
    except ApplianceError as e:
        print(f"appliance serve: {e.message}", file=sys.stderr)
        return 2
    logging.getLogger("appliance").info("model file %s", ref.path)
    from web.server import serve  # the only place the core reaches the web layer

    return serve(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A local LLM serving appliance.")
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the chat page and the OpenAI-compatible API",
                           description="Serve a GGUF model (default: the embedded SmolLM2-135M-Instruct) "
                                       "with a chat page at / and an OpenAI-compatible API at /v1. "
                                       "Every flag can also be set by its APPLIANCE_* environment "
                                       "variable; flags win.")
    config.add_arguments(serve, config.EngineConfig, config.ServerConfig)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = args.func
    del args.func, args.command
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
