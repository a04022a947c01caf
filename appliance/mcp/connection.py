"""One configured MCP server, held open on the hub's event loop with the official SDK's `Client`.

The SDK's client is an async context manager whose cancel scopes must be entered and left by one
task, so each connection is a task (`_hold`) that opens the client, lists the tools, and waits
until it is told to stop; calls run in the callers' own tasks over the open session. A call that
finds the connection closed (a stdio server that exited, an HTTP server gone; listing the tools
before each call finds it) opens it again, which for stdio starts the process again; one closed during the
call is reported, and the next call opens it again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx2
import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from .settings import ServerSpec

log = logging.getLogger("appliance.tools")

CONNECT_MIN_S = 60.0     # a connection may take the server's timeout, and at least this (npx -y, uvx fetch first)
MAX_TOOL_PAGES = 20          # tools/list pages read at most: a server that pages forever cannot hang a connect


class Unavailable(Exception):
    """The server cannot be reached now; the message says why."""


def describe(e: BaseException) -> str:
    """A short account of an error for the log and the page: the first leaf of an exception
    group (anyio's task groups wrap what failed), its type, its message."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, (MCPError, Unavailable)):
        return e.message if isinstance(e, MCPError) else str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Connection:
    """A server's state (idle, connecting, ready, failed, lost, closed), its tools, its client."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.state = "idle"
        self.error: str | None = None
        self.tools: tuple[mcp_types.Tool, ...] = ()
        self._client: Client | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self.attempted = 0.0          # time.monotonic() of the last connection attempt

    @property
    def connect_timeout(self) -> float:
        return max(self.spec.timeout_s, CONNECT_MIN_S)

    def _target(self) -> Any:
        spec = self.spec
        if spec.command:
            return StdioServerParameters(command=spec.command, args=list(spec.args), env=dict(spec.env),
                                         cwd=spec.cwd)
        http = httpx2.AsyncClient(headers=dict(spec.headers),
                                  timeout=httpx2.Timeout(spec.timeout_s, read=max(spec.timeout_s, 300.0)))
        return streamable_http_client(spec.url, http_client=http)

    async def ensure(self) -> None:
        """Open the connection unless it is; Unavailable says why it cannot be."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.state == "ready" and self._client is not None:
                return
            await self._open()
        if self.state != "ready":
            raise Unavailable(self.error or "not connected")

    async def _open(self) -> None:
        await self._drop()
        self.state, self.error, self.attempted = "connecting", None, time.monotonic()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._hold(ready, self._stop), name=f"mcp:{self.spec.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout)
        except TimeoutError:
            self._fail(f"did not connect within {self.connect_timeout:g} s")
            await self._drop()
        except Exception as e:
            self._fail(describe(e))
            await self._drop()

    def _fail(self, why: str) -> None:
        self.state, self.error, self.tools = "failed", why, ()
        log.warning("MCP server %s (%s): %s", self.spec.name, self.spec.transport, why)

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        try:
            async with Client(self._target(), cache=None) as client:
                tools = await _list_tools(client)
                self._client, self.tools, self.state = client, tools, "ready"
                log.info("MCP server %s (%s): %d tools", self.spec.name, self.spec.transport, len(tools))
                ready.set_result(None)
                await stop.wait()
        except BaseException as e:  # the SDK's task groups raise groups; cancellation is ours
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else Unavailable(describe(e)))
            elif not isinstance(e, asyncio.CancelledError):
                log.info("MCP server %s closed: %s", self.spec.name, describe(e))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if self._stop is stop:   # not a newer connection's
                self._client = None
                if self.state == "ready":
                    self.state, self.error = "lost", "the connection closed"

    async def prepare(self) -> None:
        """Open, and answering: a stdio server that exited while idle starts again here.
        Unavailable says why it cannot be."""
        await self.ensure()
        if not await self._alive():
            self.state, self.error = "lost", "the connection had closed"
            await self.ensure()

    async def call(self, tool: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        """The server's result for `tool`, on the connection `prepare` opened (the hub bounds it
        in time); Unavailable when its connection closes during the call (dropped: the next call
        opens it again)."""
        client = self._client
        if client is None:
            raise Unavailable("the connection closed")
        try:
            return await client.call_tool(tool, arguments)
        except MCPError as e:
            if e.code != mcp_types.CONNECTION_CLOSED:
                raise
            self.state, self.error = "lost", "the connection closed during a call"
            log.warning("MCP server %s: the connection closed during a call to %s", self.spec.name, tool)
            await self._drop()
            raise Unavailable(f"server {self.spec.name}'s connection closed during the call "
                              "(it is opened again on the next call)") from None

    async def _alive(self) -> bool:
        """Whether the open session still answers: it lists its tools again (which keeps the list
        fresh; the 2026 protocol has no ping), and a closed one fails at once."""
        client = self._client
        try:
            if client is not None:
                self.tools = await asyncio.wait_for(_list_tools(client), min(5.0, self.spec.timeout_s))
                return True
        except MCPError as e:
            if e.code != mcp_types.CONNECTION_CLOSED:
                return True   # it answered: alive enough to call
        except TimeoutError:
            return True       # busy: the call has its own timeout
        except Exception:  # noqa: BLE001 - a transport's error: open it again
            pass
        await self._drop()
        return False

    async def _drop(self) -> None:
        """Stop the holding task, waiting a bounded time for the client to close (a stdio
        server's process is stopped by the SDK: stdin closed, then SIGTERM, then SIGKILL)."""
        task, stop = self._task, self._stop
        self._task, self._client = None, None
        if task is None:
            return
        if stop is not None:
            stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), 8.0)
        except BaseException:  # noqa: BLE001 - a task that will not end is cancelled
            task.cancel()

    async def close(self) -> None:
        await self._drop()
        self.state = "closed"


async def _list_tools(client: Client) -> tuple[mcp_types.Tool, ...]:
    tools: list[mcp_types.Tool] = []
    cursor = None
    for _ in range(MAX_TOOL_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tuple(tools)
