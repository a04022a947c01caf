"""What the chat-format tests compare with: llama.cpp's own parse of each reply
(chat_templates/llama_chat.json, recorded by scripts/llama_chat_reference/), and the check that a
reply streamed in pieces gives the message it gives whole."""
from __future__ import annotations

import json
import random
from typing import Any, Iterable

from appliance.engine.chat_formats import Context, Format
from appliance.engine.chat_formats.stream import ChatStream

from ..chat_templates import cases


def reference() -> dict[str, Any]:
    path = cases.HERE / "llama_chat.json"
    return json.loads(path.read_text()) if path.exists() else {}


def context(fmt: Format, request: dict[str, Any], generation_prompt: str = "") -> Context:
    """The parse context of a recorded request: its tools, its reasoning format, and whether
    llama.cpp's generation prompt left the reply inside a thinking block."""
    tools = {t["function"]["name"]: t["function"].get("parameters") or {}
             for t in request.get("tools") or [] if request.get("tool_choice", "auto") != "none"}
    return Context(tools=tools, thinking_open=fmt.prompt_opens_thinking(generation_prompt),
                   extract_reasoning=request.get("reasoning_format", "deepseek") != "none",
                   parallel=request.get("parallel_tool_calls", True))


def message(fmt: Format, ctx: Context, reply: str) -> dict[str, Any]:
    """The message the appliance reads from a whole reply, as the reference writes it."""
    got = fmt.parse(reply, ctx, partial=False)
    return {"content": got.content, "reasoning_content": got.reasoning,
            "tool_calls": [{"name": c.name, "arguments": json.loads(c.arguments or "{}")} for c in got.calls]}


def expected(msg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's message in the same shape (arguments compared as JSON values)."""
    return {"content": msg.get("content") or "", "reasoning_content": msg.get("reasoning_content") or "",
            "tool_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}
                           for c in msg.get("tool_calls") or []]}


def streamed(fmt: Format, ctx: Context, reply: str, sizes: Iterable[int]) -> dict[str, Any]:
    """The message a client puts together from the stream of `reply` fed in pieces of `sizes`."""
    s = ChatStream(fmt, ctx)
    content, reasoning, names, args = "", "", {}, {}
    pos, sizes = 0, iter(sizes)
    pieces = []
    while pos < len(reply):
        n = next(sizes, 1)
        pieces.append(s.feed(reply[pos:pos + n]))
        pos += n
    pieces.append(s.flush())
    for p in pieces:
        content += p.content
        reasoning += p.reasoning
        for part in p.parts:
            if part.name:
                names[part.index] = part.name
            args[part.index] = args.get(part.index, "") + part.arguments
    return {"content": content, "reasoning_content": reasoning,
            "tool_calls": [{"name": names[i], "arguments": json.loads(args.get(i) or "{}")} for i in sorted(names)]}


def chunkings(seed: int = 0) -> list[list[int]]:
    """Ways to cut a reply: a character at a time, and random pieces of 1-7."""
    rnd = random.Random(seed)
    return [[1] * 100000, [rnd.randint(1, 7) for _ in range(100000)]]


def kept_what_llama_cpp_dropped(got: dict, want: dict, reply: str) -> bool:
    """Where llama.cpp's parser drops text it cannot read (Qwen3-Coder's parser: a block that is
    no call of the request's tools, and what follows it), the appliance keeps it as content (a
    bad reply loses nothing): the same reasoning and calls, and the content llama.cpp's followed
    by text of the reply."""
    extra = got["content"][len(want["content"]):]
    return (got["reasoning_content"] == want["reasoning_content"] and got["tool_calls"] == want["tool_calls"]
            and got["content"].startswith(want["content"]) and bool(extra.strip()) and extra.strip() in reply)
