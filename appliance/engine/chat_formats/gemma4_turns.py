"""Gemma 4's earlier turns as its older templates take them (llama.cpp's
workaround::convert_tool_responses_gemma4): an assistant's calls, the tool results after them and
the answer after those become one assistant message with `tool_responses`, as Google's prompt
guide writes a model turn. Templates that carry their own conversion (the ones that say
"OpenAI Chat Completions:") get the messages as they are."""
from __future__ import annotations

import json
from typing import Any

CONVERTS_ITSELF = "{#- OpenAI Chat Completions:"


def fold_tool_responses(msgs: list[dict[str, Any]], src: str) -> list[dict[str, Any]]:
    if CONVERTS_ITSELF in src:
        return msgs
    out, i = [], 0
    while i < len(msgs):
        m = msgs[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        turn, i = _turn(msgs, i)
        out.append(turn)
    return out


def _turn(msgs: list[dict[str, Any]], i: int) -> tuple[dict[str, Any], int]:
    """The model turn that starts at msgs[i] (an assistant's calls), and where the next begins."""
    first = msgs[i]
    calls, responses = list(first["tool_calls"]), []
    i += 1
    while i < len(msgs) and msgs[i].get("role") == "tool":
        responses.append(_response(msgs[i], calls, len(responses)))
        i += 1
    turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    if responses:
        turn["tool_responses"] = responses
    if i < len(msgs) and msgs[i].get("role") == "assistant" and not msgs[i].get("tool_calls") \
            and msgs[i].get("content"):
        turn["content"] = msgs[i]["content"]
        i += 1
    if isinstance(first.get("reasoning_content"), str):
        turn["reasoning_content"] = first["reasoning_content"]
    return turn, i


def _response(tool: dict[str, Any], calls: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """A tool result as Gemma 4 names it: the call it answers (in order), its content as JSON
    where it reads as JSON."""
    content = tool.get("content")
    try:
        response = json.loads(content) if isinstance(content, str) else content
    except ValueError:
        response = content
    name = calls[n].get("function", {}).get("name", "") if n < len(calls) else ""
    return {"name": name or tool.get("tool_call_id", ""), "response": response}
