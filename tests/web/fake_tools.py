"""A ToolHub for the chat jobs' tests (the interface web/chat_job_tools.py programs against; the
MCP client layer is the real one): a tool that adds numbers, one that hangs past the hub's
timeout, and one the owner lets run unasked; and a scripted model that calls them."""
from __future__ import annotations

import threading
import time

from appliance.mcp.hub import ServerStatus, ToolInfo, ToolResult

from .agents import QWEN3_CODER

REPLY = "Paris is the capital of France."
SEEN: list = []     # every request the scripted model answered


def director(request) -> str:
    """The scripted model (Qwen3-Coder's format): calls the first tool it is offered until a
    result is in, then answers with the results."""
    SEEN.append(request)
    results = [m.content for m in request.messages or () if m.role == "tool"]
    names = [t.name for t in request.tools]
    if results:
        return "Result: " + " ".join(str(r) for r in results)
    if names:
        args = {"a": 2, "b": 3} if names[0] == "add" else {}
        return QWEN3_CODER.call(names[0], args)
    return REPLY


NUMBERS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
           "required": ["a", "b"]}


class FakeHub:
    """`add` sums a and b, `hang` sleeps until released (cut off at `timeout_s`), `clock` runs
    unasked (auto_approve) and says the time. `calls` records every call run."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.calls: list[tuple[str, dict]] = []
        self.release = threading.Event()

    def tools(self) -> list[ToolInfo]:
        empty = {"type": "object", "properties": {}}
        return [ToolInfo("add", "fake", "Add two numbers.", NUMBERS, False, "add"),
                ToolInfo("hang", "fake", "Never answers.", empty, False, "hang"),
                ToolInfo("clock", "fake", "The time.", empty, True, "clock")]

    def status(self) -> list[ServerStatus]:
        """As the real hub's /api/tools reads it: one server, ready, with the tools above."""
        return [ServerStatus("fake", "stdio", "ready", None, tuple(self.tools()))]

    def call(self, name: str, arguments: dict) -> ToolResult:
        self.calls.append((name, arguments))
        out: dict[str, str] = {}
        t0 = time.monotonic()
        worker = threading.Thread(target=lambda: out.update(text=self._run(name, arguments)), daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return ToolResult(False, "", False, f"timed out after {self.timeout_s:g} s", time.monotonic() - t0)
        return ToolResult(True, out["text"], False, None, time.monotonic() - t0)

    def _run(self, name: str, arguments: dict) -> str:
        if name == "add":
            return str(arguments["a"] + arguments["b"])
        if name == "hang":
            self.release.wait(600)
            return "late"
        return "12:00"
