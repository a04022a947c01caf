"""Tool calls: the formats chat templates use, detected from the template, parsed from output
(streamed or whole), and the grammar that constrains `required` / named tool choices.

Formats:
  hermes   Qwen / Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, repeated
  llama3   Llama 3.x: the whole reply is {"name": ..., "parameters": {...}} (or after <|python_tag|>)
  mistral  Mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
  generic  a template with no tool support (the embedded SmolLM2): the tools and the hermes
           format are described in a system message, and parsed as hermes
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from .. import jsondepth
from .types import ChatMessage, ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


def detect_format(template: str | None) -> str:
    src = template or ""
    if OPEN in src:
        return "hermes"
    if MISTRAL_TAG in src:
        return "mistral"
    if "tools" in src and ("<|start_header_id|>" in src or PYTHON_TAG in src):
        return "llama3"
    return "generic"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_dicts(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    """The tools as Hugging Face chat templates expect them."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters_json)}} for t in tools]


def generic_system_prompt(tools: tuple[ToolSpec, ...]) -> str:
    lines = "\n".join(json.dumps(d["function"]) for d in tool_dicts(tools))
    return ("You can call functions. The available functions, as JSON schemas:\n" + lines +
            f"\nTo call one, reply with {OPEN}\n{{\"name\": <function name>, \"arguments\": "
            f"<arguments object>}}\n{CLOSE} and nothing else. Results come back as tool messages.")


def with_generic_tools(messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...]) -> tuple[ChatMessage, ...]:
    """For templates without tool support: tools described in the system message, earlier calls
    written out in the hermes format so the model sees its own convention."""
    out = []
    for m in messages:
        if m.tool_calls:
            text = "\n".join(f'{OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{CLOSE}'
                             for c in m.tool_calls)
            m = ChatMessage(m.role, ((m.content or "") + "\n" + text).strip(), m.name)
        out.append(m)
    prompt = generic_system_prompt(tools)
    if out and out[0].role == "system":
        out[0] = ChatMessage("system", (out[0].content or "") + "\n\n" + prompt, out[0].name)
    else:
        out.insert(0, ChatMessage("system", prompt))
    return tuple(out)


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = jsondepth.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str, fmt: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split a whole reply into (content, tool calls). Text that does not parse stays content,
    and so does JSON nested past jsondepth.MAX_DEPTH (a model can write any depth; the parser's
    stack cannot take it)."""
    if fmt == "mistral" and MISTRAL_TAG in text:
        head, _, tail = text.partition(MISTRAL_TAG)
        try:
            arr = jsondepth.loads(tail.strip())
        except ValueError:
            return text, []
        calls = [_call(o, names) for o in (arr if isinstance(arr, list) else [arr])]
        return (head.strip(), calls) if calls and all(calls) else (text, [])
    if fmt == "llama3":
        body = text.split(PYTHON_TAG, 1)[-1].strip()
        try:
            call = _call(jsondepth.loads(body), names)
        except ValueError:
            call = None
        return ("", [call]) if call else (text, [])
    content, calls, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, rest = after.partition(CLOSE)
        try:
            call = _call(jsondepth.loads(body.strip()), names) if closed else None
        except ValueError:
            call = None
        if call is None:
            content.append(before + OPEN + body + (CLOSE if closed else ""))
            continue
        content.append(before)
        calls.append(call)
    content.append(rest)
    return "".join(content).strip() if calls else text, calls


@dataclass
class Piece:
    content: str = ""
    calls: tuple[ToolCall, ...] = ()


class StreamParser:
    """Streams content while holding back anything that may be a tool call, and emits each call
    whole as soon as it closes (hermes/generic) or at the end (llama3, mistral)."""

    def __init__(self, fmt: str, names: set[str]) -> None:
        self.fmt, self.names = fmt, names
        self.buf = ""
        self.in_call = False
        self.whole = fmt in ("llama3", "mistral")
        self.streaming = False  # whole formats: the reply turned out not to be a call
        self.n_calls = 0

    def feed(self, text: str) -> Piece:
        self.buf += text
        if self.whole:
            return self._feed_whole()
        out, calls = [], []
        while True:
            if not self.in_call:
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, OPEN)
                    out.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at:], True
            end = self.buf.find(CLOSE)
            if end < 0:
                break
            block, self.buf, self.in_call = self.buf[: end + len(CLOSE)], self.buf[end + len(CLOSE):], False
            content, got = parse(block, "hermes", self.names)
            out.append(content if not got else "")
            calls += got
        self.n_calls += len(calls)
        return Piece("".join(out), tuple(calls))

    def _feed_whole(self) -> Piece:
        # a reply that starts like a call is held to the end; anything else streams
        start = self.buf.lstrip()
        markers = (MISTRAL_TAG if self.fmt == "mistral" else "{", PYTHON_TAG)
        if not self.streaming and any(start.startswith(m) or m.startswith(start) for m in markers):
            return Piece()
        self.streaming = True
        out, self.buf = self.buf, ""
        return Piece(out)

    def flush(self) -> Piece:
        text, self.buf = self.buf, ""
        if not text:
            return Piece()
        content, calls = parse(text, "hermes" if not self.whole else self.fmt, self.names)
        self.n_calls += len(calls)
        return Piece(content, tuple(calls))


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def grammar(tools: tuple[ToolSpec, ...], choice: str, parallel: bool, fmt: str) -> str:
    """A Lark grammar (llguidance) whose every sentence is a valid call of the allowed tools."""
    allowed = [t for t in tools if choice in ("required", t.name)]
    key = "parameters" if fmt == "llama3" else "arguments"
    one = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", key],
                      "properties": {"name": {"const": t.name}, key: json.loads(t.parameters_json)}}
                     for t in allowed]}
    if fmt == "llama3":
        return f"start: %json {json.dumps(one)}\n"
    if fmt == "mistral":
        arr = {"type": "array", "minItems": 1, "maxItems": None if parallel else 1, "items": one}
        arr = {k: v for k, v in arr.items() if v is not None}
        return f'start: "{MISTRAL_TAG}" %json {json.dumps(arr)}\n'
    rep = "+" if parallel else ""
    return (f'start: call{rep}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(one)}\n')
