"""An MCP server for the tests, written with the SDK's MCPServer (FastMCP in mcp 1.x): a tool
that adds numbers, one that hangs, one with a huge result, one that fails, and two that end its
own process (during the call, or just after it). `python toy_server.py stdio` serves on stdin/stdout; `python toy_server.py http
PORT` serves streamable HTTP at http://127.0.0.1:PORT/mcp. TOY_GREETING, when set, is what the
`env` tool reads back (the test of a stdio server's environment)."""
from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("toy", log_level="CRITICAL")   # quiet: a tool's failure is the test's, not a log's


@server.tool(description="Add two numbers.")
def add(a: float, b: float) -> str:
    total = a + b
    return str(int(total) if total == int(total) else total)


@server.tool(description="Never answers.")
async def hang() -> str:
    await asyncio.sleep(3600)
    return "woke"


@server.tool(description="A result of n characters.")
def huge(n: int = 100_000) -> str:
    return "x" * n


@server.tool(description="Fails.")
def fail() -> str:
    raise ValueError("this tool always fails")


@server.tool(description="The server's environment: the names it has, and TOY_GREETING.")
def env() -> str:
    return f"{os.environ.get('TOY_GREETING', '')}|{','.join(sorted(os.environ))}"


@server.tool(description="The server's process id.")
def pid() -> str:
    return str(os.getpid())


@server.tool(description="Ends the server's process.")
def die() -> str:
    os._exit(3)


@server.tool(description="Ends the server's process a moment after it answers.")
async def die_soon() -> str:
    asyncio.get_running_loop().call_later(0.2, os._exit, 3)
    return "bye"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
