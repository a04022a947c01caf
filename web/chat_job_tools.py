"""A chat job's tools: the conversation's chosen tools offered to the model, and a reply's tool
calls held for the person's decision (approve, approve always for this tool, deny) before the
job runs them through the app's ToolHub.

The hub is the MCP layer's `ToolHub` (appliance/mcp/hub.py), in `app.extensions["appliance.tools"]`
(None or absent: no MCP server configured): `tools()` lists what the model may be offered,
`call(name, arguments)` runs one and never raises for a tool's own failure or timeout.

Only a tool the conversation chose (settings "tools") and the hub lists is offered or run: a
call the model makes to any other name is answered with an error and runs nothing.
"""
from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

from appliance.engine.types import ToolCall

from .tools import KEY as TOOLS_KEY

if TYPE_CHECKING:   # the MCP SDK is loaded only where a server is configured
    from appliance.mcp.hub import ToolHub, ToolInfo

DENIED = "denied by the user"
DECISIONS = ("approve", "always", "deny")


def chosen(hub: ToolHub | None, settings: dict[str, Any]) -> dict[str, ToolInfo]:
    """The conversation's chosen tools that the hub has, by name (none without a hub)."""
    names = settings.get("tools") or []
    if hub is None or not names:
        return {}
    have = {t.name: t for t in hub.tools()}
    return {n: have[n] for n in names if n in have}


def openai_tools(tools: dict[str, ToolInfo]) -> list[dict[str, Any]]:
    """The chosen tools as OpenAI's `tools` of a chat request."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema or {"type": "object"}}}
            for t in tools.values()]


def pending_calls(calls: Sequence[ToolCall], tools: dict[str, ToolInfo], approved: Sequence[str]) -> list[dict]:
    """A reply's calls as the job stores them while they wait: a call to a tool that runs unasked
    (the owner's auto_approve, or the person's "approve always") is decided already; a call to a
    tool not offered is denied at once (it is answered with an error)."""
    out = []
    for c in calls:
        tool = tools.get(c.name)
        decision = None
        if tool is None:
            decision = "unknown"
        elif tool.auto_approve or c.name in approved:
            decision = "auto"
        out.append({"id": c.id, "name": c.name, "arguments": c.arguments, "decision": decision,
                    "server": tool.server if tool is not None else None})
    return out


class Gate:
    """One reply's tool calls waiting for decisions; the runner waits on it, the decision route
    (another thread) fills it in."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.calls: list[dict] = []

    def open(self, calls: list[dict]) -> None:
        with self._cond:
            self.calls = calls

    def decide(self, call_id: str, decision: str) -> dict | None:
        """Record a decision on a waiting call ("always" approves every waiting call of the same
        tool); the call, or None when no waiting call has that id."""
        with self._cond:
            call = next((c for c in self.calls if c["id"] == call_id and c["decision"] is None), None)
            if call is None:
                return None
            for c in self.calls:
                if c is call or (decision == "always" and c["name"] == call["name"] and c["decision"] is None):
                    c["decision"] = decision
            self._cond.notify_all()
            return call

    def waiting(self) -> bool:
        with self._cond:
            return any(c["decision"] is None for c in self.calls)

    def wait(self, stopped: threading.Event, poll_s: float = 0.25) -> bool:
        """Until every call is decided (True) or the job is stopped (False)."""
        with self._cond:
            while any(c["decision"] is None for c in self.calls):
                if stopped.is_set():
                    return False
                self._cond.wait(poll_s)
            return not stopped.is_set()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


def run_call(hub: ToolHub | None, call: dict) -> tuple[str, dict[str, Any]]:
    """The tool message's text for a decided call, and what the page shows of its run."""
    if call["decision"] == "unknown":
        return f"error: no tool named '{call['name']}' is offered in this conversation", {"ok": False}
    if call["decision"] == "deny" or hub is None:
        return DENIED, {"ok": False, "denied": True}
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e.msg})", {"ok": False}
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object", {"ok": False}
    result = hub.call(call["name"], arguments)
    shown = {"ok": result.ok, "error": result.error, "truncated": result.truncated,
             "seconds": round(result.seconds, 3)}
    if result.ok:
        return result.text, shown
    return f"error: {result.error}" + (f"\n{result.text}" if result.text else ""), shown
