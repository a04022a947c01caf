"""The Responses API's output (web/openai_responses.py takes the request): the Response object
and its stream events, built from the engine's events.

`ResponseWriter` turns each Delta into output items in the order the model produced them
(reasoning, with the raw thinking as `reasoning_text` content and no summary; a message with one
`output_text` part; each function call as it streams: its item with its name, then its
arguments' text as the model writes them) and into the
events that say so, numbered by `sequence_number`: response.created and .in_progress, then per
item output_item.added, content_part.added, the text deltas, their .done, content_part.done,
output_item.done (function calls: arguments delta and done), and last response.completed or
response.incomplete (max_output_tokens). An error after the status line is an `error` event
and response.failed. A non-streamed reply runs the same writer and answers its final object, so
the two cannot differ.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from appliance.engine.types import Delta, Done, ToolCallPart
from appliance.errors import ApplianceError

from .responses import KEEPALIVE


def new_response(body: dict[str, Any], rid: str, model: str) -> dict[str, Any]:
    """The Response object before any output: what the request asked, echoed."""
    def given(name: str, default: Any = None) -> Any:
        return body[name] if body.get(name) is not None else default

    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": given("instructions"),
            "max_output_tokens": given("max_output_tokens"), "model": model, "output": [],
            "parallel_tool_calls": given("parallel_tool_calls", True),
            "previous_response_id": given("previous_response_id"),
            "reasoning": {"effort": None, "summary": None, **given("reasoning", {})}, "store": given("store", True),
            "temperature": given("temperature", 1.0), "text": {"format": {"type": "text"}, **given("text", {})},
            "tool_choice": given("tool_choice", "auto"), "tools": given("tools", []), "top_p": given("top_p", 1.0),
            "truncation": given("truncation", "disabled"), "usage": None, "user": given("user"),
            "metadata": given("metadata", {})}


class ResponseWriter:
    """One response's output items, built from the engine's deltas in order, and the events that
    say so (numbered by `sequence_number`). An item stays open while its kind goes on: reasoning,
    message, or a function call's arguments."""

    def __init__(self, response: dict[str, Any], suffix: str,
                 call_name: Callable[[str], dict[str, str]] = lambda name: {"type": "function_call", "name": name}
                 ) -> None:
        self.response = response
        self.call_name = call_name             # a call's item type and name as the API writes them
        self.suffix = suffix                   # the request id's unique part, in every item id
        self.seq = 0
        self.item: dict[str, Any] | None = None   # the open item (reasoning, message, call), the output's last
        self.pieces: list[str] = []            # its text (a call's arguments) so far
        self.reasoning_tokens = 0

    def _event(self, kind: str, **data: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **data}

    def start(self) -> list[dict[str, Any]]:
        shown = {**self.response, "output": []}
        return [self._event("response.created", response=shown), self._event("response.in_progress", response=shown)]

    def delta(self, ev: Delta) -> list[dict[str, Any]]:
        out = []
        if ev.reasoning:
            self.reasoning_tokens += len(ev.token_ids)
            out += self._open("reasoning")
            out.append(self._piece("response.reasoning_text.delta", ev.reasoning))
        if ev.text:
            out += self._open("message")
            out.append(self._piece("response.output_text.delta", ev.text, logprobs=[]))
        for part in ev.call_parts:
            out += self._call_part(part)
        return out

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if self.item is not None and self.item["type"] == kind:
            return []
        out = self._close("completed")
        index = len(self.response["output"])
        if kind == "reasoning":
            item = {"id": f"rs_{self.suffix}_{index}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": f"msg_{self.suffix}_{index}", "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.response["output"].append(item)
        self.item, self.pieces = item, []
        out.append(self._event("response.output_item.added", output_index=index, item={**item, "content": []}))
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part)))
        item["content"].append(part)
        return out

    def _piece(self, kind: str, text: str, **extra: Any) -> dict[str, Any]:
        self.pieces.append(text)
        return self._event(kind, item_id=self.item["id"], output_index=len(self.response["output"]) - 1,
                           content_index=0, delta=text, **extra)

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}
        if item["type"] == "function_call":
            item.update(arguments="".join(self.pieces), status=status)
            return [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=where["output_index"], item=item)]
        if item["type"] == "custom_tool_call":   # its input is the one argument the model wrote
            item.update(input=custom_input("".join(self.pieces)), status=status)
            return [self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                    self._event("response.custom_tool_call_input.done", **where, input=item["input"]),
                    self._event("response.output_item.done", output_index=where["output_index"], item=item)]
        part = item["content"][0]
        part["text"] = "".join(self.pieces)
        item["status"] = status
        where["content_index"] = 0
        done = (self._event("response.reasoning_text.done", **where, text=part["text"]) if item["type"] == "reasoning"
                else self._event("response.output_text.done", **where, text=part["text"], logprobs=[]))
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _call_part(self, part: ToolCallPart) -> list[dict[str, Any]]:
        """A call's first part opens its item (the name); the others are its arguments' deltas."""
        if part.id:
            out = self._close("completed")
            index = len(self.response["output"])
            named = self.call_name(part.name)
            custom = named["type"] == "custom_tool_call"
            item = {"id": f"{'ctc' if custom else 'fc'}_{self.suffix}_{index}", "status": "in_progress",
                    "call_id": part.id, **named, **({"input": ""} if custom else {"arguments": ""})}
            self.response["output"].append(item)
            self.item, self.pieces = item, []
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            return out
        self.pieces.append(part.arguments)
        if self.item["type"] == "custom_tool_call":   # the input is whole once the call is
            return []
        return [self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                            output_index=len(self.response["output"]) - 1, delta=part.arguments)]

    def end(self, done: Done) -> list[dict[str, Any]]:
        incomplete = done.finish_reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        u = done.usage
        self.response.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            completed_at=None if incomplete else int(time.time()),
            # cache_write_tokens are OpenAI's billed writes of explicit caching; this prompt cache is automatic
            usage={"input_tokens": u.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                   "output_tokens": u.completion_tokens,
                   "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, u.completion_tokens)},
                   "total_tokens": u.total_tokens},
            timings=done.timings.as_dict())
        return out + [self._event("response.incomplete" if incomplete else "response.completed", response=self.response)]

    def error(self, e: ApplianceError) -> list[dict[str, Any]]:
        """An error after the status line: the `error` event, then the response failed."""
        self.response.update(status="failed", error={"code": "server_error", "message": e.message})
        return [self._event("error", code=e.code, message=e.message, param=e.param),
                self._event("response.failed", response=self.response)]


def custom_input(arguments: str) -> str:
    """A custom tool call's input: the `input` of the arguments the model wrote (their text as
    it is when they are not that object: a call cut off)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
                    for ev in events)


@dataclass
class SseWriter:
    """A ResponseWriter's events as server-sent events, for `serving.stream_response`; the finished
    response goes to `finished` (the store)."""

    writer: ResponseWriter
    finished: Callable[[dict[str, Any]], None]

    def start(self) -> bytes:
        return sse(self.writer.start())

    def delta(self, ev: Delta) -> bytes:
        return sse(self.writer.delta(ev))

    def end(self, done: Done) -> bytes:
        out = sse(self.writer.end(done))
        self.finished(self.writer.response)
        return out

    def error(self, e: ApplianceError) -> bytes:
        return sse(self.writer.error(e))

    @staticmethod
    def idle() -> bytes:
        return KEEPALIVE
