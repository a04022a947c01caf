"""Tools as a prompt gets them: as Hugging Face chat templates take them (`tool_dicts`), and, for
a template with no tool support whose format no family reads (the embedded SmolLM2's), described
in a system message with earlier calls written in the generic format the description asks for
(hermes `<tool_call>` JSON, read back by chat_formats.Generic). Replies are read by chat_formats/.
"""
from __future__ import annotations

import json
from typing import Any

from .types import ChatMessage, ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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
