"""ToolHub: the configured MCP servers' tools, listed and called from any thread.

The web server is synchronous (waitress threads); the SDK is async. The hub owns one asyncio
event loop in a daemon thread, where every connection (connection.py) lives; `tools()`, `call()`
and `status()` hand coroutines to it and wait for their results, so any thread may call them at
once. Each server connects at start, in the background: one that fails is logged and reported by
`status()` (and so by /api/tools), and is tried again when the tools are listed RETRY_S later
(or on a call to one of its tools); the appliance serves meanwhile. A call never raises for the
tool's own failure, a dead server or a timeout: its ToolResult says what happened.

A tool's name as the model sees it is `SERVER__TOOL` (characters outside [A-Za-z0-9_-] as `_`, at
most 64, the end a hash of the whole when longer): unique across servers, and the same from one
start to the next, so a conversation's chosen tools keep naming them.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Iterable

import mcp_types

from .connection import Connection, Unavailable, describe
from .settings import ServerSpec

log = logging.getLogger("appliance.tools")

WAIT_S = 10.0          # status() and tools() wait at most this for connections being tried
RETRY_S = 30.0         # a server that failed to connect is tried again when listed this long after


@dataclass(frozen=True)
class ToolInfo:
    name: str                    # the function name the model sees (TOOL_NAME), unique across servers
    server: str
    description: str
    input_schema: dict
    auto_approve: bool           # runs without asking the person
    tool: str = ""               # the server's own name for it


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str                    # at most the server's max_result_chars
    truncated: bool
    error: str | None            # why not ok: "timed out after 30 s", the tool's own error...
    seconds: float


@dataclass(frozen=True)
class ServerStatus:
    name: str
    transport: str               # stdio | http
    state: str                   # idle | connecting | ready | failed | lost | closed
    error: str | None
    tools: tuple[ToolInfo, ...]


def model_name(server: str, tool: str) -> str:
    """`SERVER__TOOL` in the characters a function name may hold, at most 64 of them."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}__{tool}")
    if len(name) <= 64:
        return name
    return name[:55] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]


def result_text(result: mcp_types.CallToolResult) -> str:
    """A tool's content as text: text blocks as they are, a resource's text, the others named."""
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource):
            res = block.resource
            parts.append(getattr(res, "text", None) or f"[resource {res.uri}, {res.mime_type or 'binary'}]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource link {block.uri}]")
        else:   # images, audio: named, not inlined into a text result
            parts.append(f"[{block.type}: {getattr(block, 'mime_type', '') or 'data'}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _bounded(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


class ToolHub:
    """The tools of the configured servers. `close()` ends the connections and the loop."""

    def __init__(self, specs: Iterable[ServerSpec]) -> None:
        self._conns = {s.name: Connection(s) for s in specs}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-tools", daemon=True)
        self._thread.start()
        self._started = {name: self._submit(c.ensure()) for name, c in self._conns.items()}
        self._closed = False

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _await_start(self, wait_s: float) -> None:
        """Wait, `wait_s` at most, for the connections being tried: the first ones, and again
        those that failed more than RETRY_S ago (one still trying is listed as connecting)."""
        now = time.monotonic()
        for name, conn in self._conns.items():
            if conn.state == "failed" and now - conn.attempted > RETRY_S and self._started[name].done():
                self._started[name] = self._submit(conn.ensure())
        for fut in list(self._started.values()):
            try:
                fut.result(timeout=max(0.0, now + wait_s - time.monotonic()))
            except (FutureTimeout, Exception):  # noqa: BLE001 - the connection's state says why
                pass

    def _infos(self, conn: Connection) -> tuple[ToolInfo, ...]:
        spec = conn.spec
        return tuple(ToolInfo(model_name(spec.name, t.name), spec.name, t.description or "", dict(t.input_schema),
                              spec.approves(t.name), t.name) for t in conn.tools)

    def status(self, wait_s: float = WAIT_S) -> list[ServerStatus]:
        """Every configured server: its transport, state, error and tools, once the connections
        being tried are made or `wait_s` has passed."""
        self._await_start(wait_s)
        return [ServerStatus(n, c.spec.transport, c.state, c.error, self._infos(c)) for n, c in self._conns.items()]

    def tools(self, wait_s: float = WAIT_S) -> list[ToolInfo]:
        """The tools of the servers connected now (waiting `wait_s` at most for those connecting)."""
        return [t for s in self.status(wait_s) for t in s.tools]

    def _find(self, name: str) -> tuple[Connection, str] | None:
        for conn in self._conns.values():
            for t in conn.tools:
                if model_name(conn.spec.name, t.name) == name:
                    return conn, t.name
        return None

    def _server_of(self, name: str) -> Connection | None:
        """The server a name not listed now would belong to (its tools are listed when it connects)."""
        return next((c for c in self._conns.values() if name.startswith(model_name(c.spec.name, ""))), None)

    def call(self, name: str, arguments: dict) -> ToolResult:
        """Run the tool the model calls `name` with `arguments`; never raises for the tool's own
        failure, a dead server or a timeout. Safe from any thread but the hub's own."""
        t0 = time.monotonic()
        if self._closed or threading.current_thread() is self._thread:
            return ToolResult(False, "", False, "the tool hub is closed" if self._closed else
                              "call() from the hub's own thread would wait on itself", 0.0)
        if not isinstance(arguments, dict):
            return ToolResult(False, "", False, "arguments must be a JSON object", 0.0)
        found = self._find(name)
        conn = found[0] if found else self._server_of(name)
        if conn is None:
            return ToolResult(False, "", False, f"no configured MCP server has a tool {name!r}", 0.0)
        spec = conn.spec
        # connecting (when it must) and the call each have their timeout; this bounds both
        fut = self._submit(self._run(conn, name, arguments))
        try:
            result = fut.result(timeout=conn.connect_timeout + spec.timeout_s + 10.0)
        except FutureTimeout:
            fut.cancel()
            result = ToolResult(False, "", False, f"timed out after {spec.timeout_s:g} s", 0.0)
        except Exception as e:  # noqa: BLE001 - a call's failure is its result
            result = ToolResult(False, "", False, describe(e), 0.0)
        return ToolResult(result.ok, result.text, result.truncated, result.error, round(time.monotonic() - t0, 3))

    async def _run(self, conn: Connection, name: str, arguments: dict) -> ToolResult:
        spec = conn.spec
        try:
            await conn.prepare()
        except Unavailable as e:
            return ToolResult(False, "", False, f"server {spec.name} is unavailable: {e}", 0.0)
        found = self._find(name)
        if found is None or found[0] is not conn:
            return ToolResult(False, "", False, f"server {spec.name} has no tool {name!r}", 0.0)
        try:
            result = await asyncio.wait_for(conn.call(found[1], arguments), spec.timeout_s)
        except TimeoutError:
            log.warning("MCP tool %s timed out after %g s", name, spec.timeout_s)
            return ToolResult(False, "", False, f"timed out after {spec.timeout_s:g} s", 0.0)
        except Exception as e:  # noqa: BLE001 - the SDK's errors (a bad argument, a closed server) are results
            return ToolResult(False, "", False, describe(e), 0.0)
        text, cut = _bounded(result_text(result), spec.max_result_chars)
        error = "the tool reported an error" if result.is_error else None
        return ToolResult(not result.is_error, text, cut, error, 0.0)

    def close(self) -> None:
        """Close every connection (stdio servers stopped), then the loop; bounded in time."""
        if self._closed:
            return
        self._closed = True

        async def close_all() -> None:
            await asyncio.gather(*(c.close() for c in self._conns.values()), return_exceptions=True)

        try:
            self._submit(close_all()).result(timeout=15.0)
        except Exception as e:  # noqa: BLE001 - closing goes on
            log.warning("MCP servers did not all close: %s", describe(e))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
