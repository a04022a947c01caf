"""The toy MCP server (tests/mcp/toy_server.py) on stdio, its `add` tool writing each call it runs
as a JSON line to the file its one argument names: what shows that a denied call never ran.

    python toy_logged.py CALLS_FILE
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mcp"))
import toy_server  # noqa: E402 - found through the path just given

CALLS = sys.argv[1]


def add(a: float, b: float) -> str:
    with open(CALLS, "a") as f:
        f.write(json.dumps({"a": a, "b": b}) + "\n")
    return toy_server.add(a, b)


if __name__ == "__main__":
    toy_server.server.remove_tool("add")
    toy_server.server.add_tool(add, description="Add two numbers.")
    toy_server.server.run("stdio")
