"""`appliance template render|parse`: a model's chat layer run alone, for someone who downloads a
new model and asks whether its tool calls will parse.

`render` reads an OpenAI chat request (stdin or --request FILE) and prints the prompt exactly as
the server builds it. `parse` reads a model's raw reply on stdin, with the request it answered
(--request FILE: its tools and kwargs; the prompt decides forced-open thinking), and prints the
assistant message as the non-streamed API returns it. Both take --model GGUF (its template, BOS
and EOS, read through llama.cpp's vocabulary-only load) or --chat-template NAME|FILE.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = ("Run a model's chat layer alone: `render` prints the prompt the server builds for an "
               "OpenAI chat request; `parse` prints the message the server reads from a raw reply.")


def add_parser(sub) -> None:
    p = sub.add_parser("template", help="render a chat request, or parse a raw reply, as the server does",
                       description=DESCRIPTION)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, text in (("render", "print the prompt of an OpenAI chat request (stdin or --request)"),
                       ("parse", "print the assistant message read from a raw reply on stdin")):
        v = verbs.add_parser(verb, help=text, description=text)
        src = v.add_mutually_exclusive_group()
        src.add_argument("--model", metavar="GGUF", help="the model whose template (and BOS/EOS) to use "
                                                         "(default: the embedded model)")
        src.add_argument("--chat-template", metavar="NAME|FILE", help="a built-in template name or a Jinja file")
        v.add_argument("--request", metavar="FILE", help="the OpenAI chat request as JSON"
                                                         + (" (default: stdin)" if verb == "render" else
                                                            ": its tools, tool_choice and kwargs"))
        v.add_argument("--chat-template-kwargs", metavar="JSON", help="template variables every request gets")
        v.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default="auto",
                       help="reasoning in reasoning_content (auto, deepseek) or left in the content (none)")
        v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .errors import ApplianceError

    try:
        layer = _layer(args)
        if args.verb == "render":
            body = _read_request(args.request or "-")
            sys.stdout.write(layer.render(_request(body)))
            return 0
        body = _read_request(args.request) if args.request else {"messages": [{"role": "user", "content": ""}]}
        req = _request(body)
        message = parse(layer, req, sys.stdin.read())
        print(json.dumps(message, ensure_ascii=False, indent=2))
        return 0
    except (ApplianceError, ValueError, OSError) as e:
        print(f"appliance template {args.verb}: {getattr(e, 'message', None) or e}", file=sys.stderr)
        return 2


def parse(layer, req, reply: str) -> dict[str, Any]:
    """The assistant message the API returns for `reply` to `req` (its prompt rendered first:
    forced-open thinking is read from it)."""
    from .engine.types import ToolCall

    parser = layer.parser(req, layer.render(req))
    a, b = parser.feed(reply), parser.flush()
    calls: list[ToolCall] = [*a.calls, *b.calls]
    message: dict[str, Any] = {"role": "assistant", "content": (a.content + b.content) or None}
    reasoning = a.reasoning + b.reasoning
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message


def _layer(args: argparse.Namespace):
    from .chat_templates import default_kwargs, load_template
    from .engine.chat_layer import ChatLayer

    kwargs = default_kwargs(args.chat_template_kwargs)
    if args.chat_template:
        return ChatLayer(load_template(args.chat_template)[1], template_kwargs=kwargs,
                         reasoning_format=args.reasoning_format)
    template, bos, eos = _model_template(args.model)
    return ChatLayer(template, bos, eos, kwargs, args.reasoning_format)


def _model_template(model: str | None) -> tuple[str | None, str, str]:
    """A GGUF's chat template, BOS and EOS text, as the engine reads them (vocabulary only)."""
    import llama_cpp as L

    from .engine.runners.vocab import Vocab, load_model
    from .models import embedded_model_path

    path = Path(model) if model else embedded_model_path()
    if not path.is_file():
        raise ValueError(f"{path}: no such model file")
    handle = load_model(path, vocab_only=True)
    try:
        facts = Vocab(handle).facts()
    finally:
        L.llama_model_free(handle)
    return facts["chat_template"], facts["bos_text"] or "", facts["eos_text"] or ""


def _read_request(where: str) -> dict[str, Any]:
    text = sys.stdin.read() if where == "-" else Path(where).read_text()
    try:
        body = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the request is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the request must be a JSON object (an OpenAI chat request)")
    return body


def _request(body: dict[str, Any]):
    """The engine request of an OpenAI chat body, read as the server reads it."""
    from web.wire import parse_chat

    body = {"model": "m", **body}
    return parse_chat(body, "template", {body["model"]}, 1 << 30).request
