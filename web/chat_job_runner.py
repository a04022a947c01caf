"""The thread that runs one chat job: a chat request through the serving core (the same
`serving.parse_submit` and engine path as /v1/chat/completions, with a stop flag in place of the
client's connection), its events kept in memory for any number of subscribers and its reply
written into the conversation as it grows; then, when the reply calls tools, the calls held for
the person's decision (chat_job_tools.py), run, their results sent back, and the next reply,
up to the step limit.

Events (`EventLog`), each one SSE event `id: SEQ` / `data: JSON` with "seq" and "type":

    message  {position, message}   a message begins at `position` (an assistant reply: what it
                                   starts from, "" or the text it continues; a tool result: whole)
    chunk    {position, chunk}     an OpenAI chat.completion.chunk of the reply at `position`
                                   (content, reasoning_content, tool_calls, prompt_progress,
                                   finish_reason with timings, usage), as /v1 streams it
    state    {job}                 the job changed state (its pending tool calls, when waiting)
    end      {job}                 the last event: the job ended (done, stopped, error)
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flask import Flask

from appliance.chat_jobs import ChatJobStore
from appliance.conversations import ConversationStore
from appliance.engine.types import Delta, Done, Progress, ToolCall
from appliance.errors import ApplianceError

from . import chat_job_tools as tools
from . import serving
from .responses import ChunkWriter, tool_call_dicts

log = logging.getLogger("appliance.jobs")

SAVE_EVERY_S = 1.0     # how often a growing reply is written into the conversation


class EventLog:
    """A job's events as SSE bytes, appended by its runner, read from any offset by subscribers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[bytes] = []
        self.ended = False

    def add(self, kind: str, raw: str) -> None:
        """Append an event whose body (JSON members, without braces) is `raw`."""
        with self._cond:
            seq = len(self.events)
            self.events.append(f'id: {seq}\ndata: {{"seq":{seq},"type":"{kind}",{raw}}}\n\n'.encode())
            self.ended = self.ended or kind == "end"
            self._cond.notify_all()

    def since(self, offset: int, timeout: float) -> tuple[list[bytes], bool]:
        """The events from `offset` on (waiting up to `timeout` for one), and whether the log ended."""
        with self._cond:
            if len(self.events) <= offset and not self.ended:
                self._cond.wait(timeout)
            return self.events[offset:], self.ended


@dataclass
class Reply:
    """An assistant reply as it grows, from its engine events."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    timings: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None

    def add(self, ev: Delta, t0: float) -> None:
        if self.ttft_ms is None and (ev.text or ev.reasoning or ev.call_parts):
            self.ttft_ms = (time.perf_counter() - t0) * 1000
        self.content += ev.text
        self.reasoning += ev.reasoning
        self.calls.extend(ev.tool_calls)

    def message(self) -> dict[str, Any]:
        timings = None if self.timings is None else {**self.timings, "ttft_ms": self.ttft_ms}
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning or None,
                "tool_calls": tool_call_dicts(self.calls) or None, "timings": timings,
                "finish_reason": self.finish_reason}


@dataclass
class JobSetup:
    """What a job runs: the chat body (the page's, with the conversation's tools), where its reply
    goes, and what it may use."""

    app: Flask
    job: dict[str, Any]
    body: dict[str, Any]
    conversations: ConversationStore
    jobs: ChatJobStore
    hub: tools.ToolHub | None
    tools: dict[str, Any]               # the chosen tools the hub has, by name
    step_limit: int
    prefix: dict[str, Any] = field(default_factory=dict)   # a continued reply's content so far


class Runner:
    """One job's thread. `stop`, `decide` and the event log are for the routes' threads."""

    def __init__(self, setup: JobSetup) -> None:
        self.s = setup
        self.id = setup.job["id"]
        self.job = setup.job
        self.log = EventLog()
        self.stopped = threading.Event()
        self.gate = tools.Gate()
        self._set_lock = threading.Lock()

    # -- the routes' side ------------------------------------------------------------------
    def start(self, first: serving.Submitted) -> None:
        threading.Thread(target=self._main, args=(first,), name=f"job-{self.id}", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()
        self.gate.wake()

    def decide(self, call_id: str, decision: str) -> dict | None:
        call = self.gate.decide(call_id, decision)
        if call is not None:
            self._set(pending=self.gate.calls)
        return call

    # -- the thread ------------------------------------------------------------------------
    def _main(self, first: serving.Submitted) -> None:
        with self.s.app.app_context():
            try:
                state, error = self._loop(first)
            except ApplianceError as e:
                state, error = "error", e.message
            except Exception:   # a bug: the job ends with an error rather than hanging in "running"
                log.exception("chat job %s failed", self.id)
                state, error = "error", "internal server error"
            self._set(state=state, error=error, pending=self.gate.calls if state == "stopped" else [])
            self.log.add("end", '"job":' + json.dumps(self.job, ensure_ascii=False))

    def _loop(self, sub: serving.Submitted) -> tuple[str, str | None]:
        body, position = dict(self.s.body), self.job["position"]
        messages = list(body["messages"])
        while True:
            reply = self._generate(sub, position, self.s.prefix)
            if self.stopped.is_set():
                return "stopped", None
            if not reply.calls or not self.s.tools:
                return "done", None
            if self.job["steps"] >= self.s.step_limit:
                return "done", (f"stopped at the step limit: {self.s.step_limit} tool rounds "
                                "(--tool-steps); the last reply's calls were not run")
            if not self._decide(reply.calls):
                return "stopped", None
            results = self._run_calls(position + 1)
            messages += [{k: v for k, v in reply.message().items() if k in ("role", "content", "tool_calls")},
                         *results]
            position += 1 + len(results)
            self._set(steps=self.job["steps"] + 1, current=position, pending=[])
            body = {**body, "messages": messages}
            body.pop("tool_choice", None)   # a forced choice is for the first reply only: then "auto"
            sub = serving.parse_submit(body, chat=True, gone=self.stopped.is_set)
            self.s.prefix = {}

    def _generate(self, sub: serving.Submitted, position: int, prefix: dict[str, Any]) -> Reply:
        """Stream one reply into the event log and the conversation at `position`."""
        reply = Reply(prefix.get("content") or "", prefix.get("reasoning_content") or "")
        self._event("message", position=position, message=reply.message())
        writer, tally, t0 = ChunkWriter(sub.parsed, True, sub.fingerprint), serving.Tally(), time.perf_counter()
        saved = time.monotonic()
        try:
            self._chunks(position, writer.start())
            while True:
                ev = serving.wait(sub.stream, self.stopped.is_set)
                if ev is None:                       # stopped: the request is aborted
                    reply.finish_reason = "cancelled"
                    break
                if isinstance(ev, Progress):
                    self._chunks(position, writer.progress(ev))
                elif isinstance(ev, Delta):
                    tally.delta(ev)
                    reply.add(ev, t0)
                    self._chunks(position, writer.delta(ev))
                elif isinstance(ev, Done):
                    tally.done(ev)
                    reply.timings, reply.finish_reason = ev.timings.as_dict(), ev.finish_reason
                    reply.ttft_ms = reply.ttft_ms if reply.ttft_ms is not None else ev.timings.prompt_ms
                    self._chunks(position, writer.end(ev))
                    break
                if time.monotonic() - saved >= SAVE_EVERY_S:
                    self.s.conversations.upsert_message(self.job["conversation_id"], position, reply.message())
                    saved = time.monotonic()
        finally:
            sub.stream.abort()
            self.s.conversations.upsert_message(self.job["conversation_id"], position, reply.message())
        return reply

    def _decide(self, calls: list[ToolCall]) -> bool:
        """Hold the calls until each is decided (those that run unasked are); False if stopped."""
        settings = self.s.conversations.get(self.job["conversation_id"])["settings"]
        self.gate.open(tools.pending_calls(calls, self.s.tools, settings.get("tools_approved") or []))
        if self.gate.waiting():
            self._set(state="waiting", pending=self.gate.calls)
        ok = self.gate.wait(self.stopped)
        if ok:
            self._set(state="running", pending=self.gate.calls)
        return ok

    def _run_calls(self, position: int) -> list[dict[str, Any]]:
        """Run the decided calls in order; each result is a tool message written at its position."""
        out = []
        for i, call in enumerate(self.gate.calls):
            text, shown = tools.run_call(self.s.hub, call)
            call["result"] = shown
            msg = {"role": "tool", "content": text, "tool_call_id": call["id"]}
            self.s.conversations.upsert_message(self.job["conversation_id"], position + i, msg)
            self._event("message", position=position + i, message=msg)
            out.append(msg)
        self._set(pending=self.gate.calls)
        return out

    # -- events and state ------------------------------------------------------------------
    def _chunks(self, position: int, data: bytes) -> None:
        """The SSE chunks a ChunkWriter wrote, each an event of the log ([DONE] dropped)."""
        for part in data.split(b"\n\n"):
            if part.startswith(b"data: {"):
                self.log.add("chunk", f'"position":{position},"chunk":' + part[6:].decode())

    def _event(self, kind: str, **members: Any) -> None:
        self.log.add(kind, json.dumps(members, ensure_ascii=False)[1:-1])

    def _set(self, **changes: Any) -> None:
        # the runner's thread and a route's (a decision) both set the job: one at a time, so the
        # stored job and the order of the state events follow the order of the changes
        with self._set_lock:
            try:
                self.job = self.s.jobs.update(self.id, **changes)
            except ApplianceError:   # its conversation was deleted, or the file failed: the events still tell
                self.job = {**self.job, **changes}
            self._event("state", job=self.job)
