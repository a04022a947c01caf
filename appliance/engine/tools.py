"""Tool calls: the formats chat templates use, detected from the template, parsed from a whole
reply (`tool_stream.py` parses them as they stream), and the grammar that constrains
`required` / named tool choices.

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


def written_calls(calls: tuple[ToolCall, ...]) -> str:
    """Calls as the generic format writes them (hermes): what a template without tools shows."""
    return "\n".join(f'{OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{CLOSE}' for c in calls)


def with_generic_tools(messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...]) -> tuple[ChatMessage, ...]:
    """For templates without tool support: tools described in the system message, earlier calls
    written out in the hermes format so the model sees its own convention."""
    out = []
    for m in messages:
        if m.tool_calls:
            m = ChatMessage(m.role, ((m.content or "") + "\n" + written_calls(m.tool_calls)).strip(), m.name)
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
