"""/api/tools: the MCP servers the owner configured (appliance/mcp) and their tools, for the chat
page's tools panel and for whoever runs a model's tool calls.

    GET  /api/tools        {"object": "list", "servers": [server...], "data": [tool...]}
    POST /api/tools/call   {"name", "arguments"?} -> {"ok", "text", "truncated", "error", "seconds"}

A server is {name, transport: stdio | http, state, error, tools}; a tool is {name (what the
model calls it), server, tool (the server's own name), description, input_schema,
auto_approve}. No server configured: both lists empty, and a call is a 404. The call route runs
a tool at once, without the page's approval (it is the caller who asks): for debugging, and
like every route but the pages it takes the API key when the server has one.

The hub is built by `serve` (web/server.py: `configured`, then `ToolHub`) and handed to
create_app, which keeps it in `app.extensions["appliance.tools"]` (None without servers).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flask import Blueprint, current_app, jsonify, request

from appliance.config import Config
from appliance.errors import InvalidRequest, NotFound
from appliance.mcp.settings import ServerSpec, read_table, server_specs

from .wire import parse_json_body

if TYPE_CHECKING:
    from appliance.mcp.hub import ToolHub

bp = Blueprint("tools", __name__)

KEY = "appliance.tools"


def configured(config: Config) -> tuple[ServerSpec, ...]:
    """The servers settings.toml (in the library's directory) and the --mcp flags give.
    ValueError names a setting that is wrong."""
    from appliance.library.index import default_root

    root = Path(config.server.library).expanduser() if config.server.library else default_root()
    return server_specs(config.server, read_table(root), config.given)


def hub() -> ToolHub | None:
    return current_app.extensions.get(KEY)


def _tool(t: Any) -> dict[str, Any]:
    return {"name": t.name, "server": t.server, "tool": t.tool, "description": t.description,
            "input_schema": t.input_schema, "auto_approve": t.auto_approve}


@bp.get("/api/tools")
def list_tools():
    h = hub()
    servers = h.status() if h is not None else []
    return jsonify({"object": "list",
                    "servers": [{"name": s.name, "transport": s.transport, "state": s.state, "error": s.error,
                                 "tools": [_tool(t) for t in s.tools]} for s in servers],
                    "data": [_tool(t) for s in servers for t in s.tools]})


@bp.post("/api/tools/call")
def call_tool():
    body = parse_json_body(request.get_data(cache=False))
    for key in body:
        if key not in ("name", "arguments"):
            raise InvalidRequest(f"unknown field '{key}'; allowed: name, arguments", param=key)
    name, arguments = body.get("name"), body.get("arguments")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'name' must be a tool's name, as GET /api/tools gives it", param="name")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidRequest("'arguments' must be an object", param="arguments")
    h = hub()
    if h is None or name not in {t.name for t in h.tools()}:
        raise NotFound(f"no tool '{name}' among the connected MCP servers' (GET /api/tools lists them)")
    return jsonify(dataclasses.asdict(h.call(name, arguments)))
