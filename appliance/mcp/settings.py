"""The MCP servers the owner configures, and nothing else: serve's flags (a mixin of
`ServerConfig`, config.py) and the `[mcp]` table of the library's `settings.toml`. A request
never names a server; the hub (hub.py) connects to these only.

    [mcp]                       # defaults for every server
    timeout_s = 30              # a call (or a connection) past this is cut off
    max_result_chars = 16384    # a result is cut to this many characters

    [mcp.servers.calc]          # stdio: a command run as the appliance's user
    command = "python3"
    args = ["-m", "calc_server"]
    env = { CALC_DIGITS = "10" }     # the server's environment, besides STDIO_INHERITED
    cwd = "/srv/calc"
    auto_approve = ["add"]           # these tools run unasked; true: every tool of the server

    [mcp.servers.search]        # streamable HTTP
    url = "http://127.0.0.1:9000/mcp"
    headers = { Authorization = "Bearer TOKEN" }
    timeout_s = 60

`--mcp NAME=URL` or `--mcp "NAME=COMMAND ARGS"` adds a server (one of the same name in the file is
replaced); `--mcp-auto-approve SERVER.TOOL,SERVER.*`, `--mcp-timeout`, `--mcp-max-result` as above
(a server's own value in the file wins over the flag, the flag over `[mcp]`'s).
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping

from .. import settings_file
from ..flags import opt

TABLE = "mcp"            # the key of settings.toml that holds no model's settings
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # a tool's name as the model sees it (hub.model_name)
SERVER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# what a stdio server gets of the appliance's environment besides its `env`: what running a
# program needs (the mcp SDK's own list, mcp.client.stdio.DEFAULT_INHERITED_ENV_VARS on POSIX)
STDIO_INHERITED = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")
_SERVER_KEYS = {"command", "args", "env", "cwd", "url", "headers", "auto_approve", "timeout_s", "max_result_chars"}


@dataclass(frozen=True)
class ToolSettings:
    """The MCP flags (a base class of ServerConfig: its fields are serve's flags)."""

    mcp: str | None = opt(None, "an MCP server whose tools the chat page may give a model: NAME=URL (streamable "
                          "HTTP) or NAME=COMMAND ARGS (stdio, run as this user); again, or comma-separated, for "
                          "several (settings.toml's [mcp.servers.NAME] takes env, headers and commas)", repeat=True)
    mcp_auto_approve: str | None = opt(None, "MCP tools that run without asking, SERVER.TOOL or SERVER.* (all of "
                                       "its tools), comma-separated (default: each call waits for approval)")
    mcp_timeout: float = opt(30.0, "seconds an MCP tool call (or a connection) may take before it is cut off")
    mcp_max_result: int = opt(16384, "characters of an MCP tool's result kept; the rest is cut off, and said to be")

    def check_tools(self) -> None:
        """ValueError for a malformed flag."""
        _check_limits(self.mcp_timeout, self.mcp_max_result, "--mcp-timeout", "--mcp-max-result")
        flag_servers(self.mcp)
        _approvals(self.mcp_auto_approve)


@dataclass(frozen=True)
class ServerSpec:
    """One configured MCP server: a stdio command or a streamable-HTTP URL, and its limits."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()        # given to the process besides STDIO_INHERITED
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    approve_all: bool = False                    # every tool runs unasked
    auto_approve: frozenset[str] = frozenset()   # these tools (the server's own names) run unasked
    timeout_s: float = 30.0
    max_result_chars: int = 16384

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    def approves(self, tool: str) -> bool:
        return self.approve_all or tool in self.auto_approve


def _check_limits(timeout: Any, bound: Any, t_name: str, b_name: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{t_name} must be a positive number of seconds, not {timeout!r}")
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 256:
        raise ValueError(f"{b_name} must be a whole number of characters, at least 256, not {bound!r}")


def _check_name(name: str, where: str) -> str:
    if not SERVER_NAME.match(name) or "__" in name:
        raise ValueError(f"{where}: the server name {name!r} must be 1-32 letters, digits, '-' or single '_'")
    return name


def flag_servers(value: str | None) -> list[tuple[str, dict[str, Any]]]:
    """--mcp's servers as (name, table), each table as settings.toml would give it."""
    out = []
    for item in (value or "").split(",") if value else []:
        name, sep, target = item.strip().partition("=")
        if not sep or not target.strip():
            raise ValueError(f"--mcp {item!r}: give NAME=URL or NAME=COMMAND ARGS")
        _check_name(name.strip(), f"--mcp {item!r}")
        target = target.strip()
        if re.match(r"^https?://", target, re.I):
            out.append((name.strip(), {"url": target}))
        else:
            try:
                argv = shlex.split(target)
            except ValueError as e:
                raise ValueError(f"--mcp {item!r}: {e}") from None
            out.append((name.strip(), {"command": argv[0], "args": argv[1:]}))
    return out


def _approvals(value: str | None) -> dict[str, set[str]]:
    """--mcp-auto-approve as {server: {tool, ...}}, "*" meaning all of its tools."""
    out: dict[str, set[str]] = {}
    for item in (value or "").split(",") if value else []:
        server, sep, tool = item.strip().partition(".")
        if not sep or not server or not tool:
            raise ValueError(f"--mcp-auto-approve {item!r}: give SERVER.TOOL or SERVER.*")
        out.setdefault(server, set()).add(tool)
    return out


def read_table(root: Path) -> dict[str, Any]:
    """The [mcp] table of `root`/settings.toml (empty without one). ValueError names the file."""
    table = settings_file.read(root).get(TABLE, {})
    if not isinstance(table, dict):
        raise ValueError(f"{root / settings_file.SETTINGS}: [{TABLE}] must be a table")
    return table


def _strings(value: Any, where: str, kind: type) -> Any:
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings")
        return tuple(value)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{where} must be a table of strings")
    return tuple(value.items())


def _spec(name: str, table: Mapping[str, Any], timeout: float, bound: int, approved: set[str], where: str) -> ServerSpec:
    unknown = set(table) - _SERVER_KEYS
    if unknown:
        raise ValueError(f"{where}: {', '.join(sorted(unknown))}: not a server setting "
                         f"(one of {', '.join(sorted(_SERVER_KEYS))})")
    command, url = table.get("command"), table.get("url")
    if (command is None) == (url is None):
        raise ValueError(f"{where}: give command (a stdio server) or url (streamable HTTP), one of them")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise ValueError(f"{where}: command must be a program to run")
    if url is not None and not (isinstance(url, str) and re.match(r"^https?://[^/\s]+", url, re.I)):
        raise ValueError(f"{where}: url must be an http:// or https:// address")
    if url is not None and ({"args", "env", "cwd"} & set(table)):
        raise ValueError(f"{where}: args, env and cwd are a stdio server's (give command)")
    if command is not None and "headers" in table:
        raise ValueError(f"{where}: headers are an HTTP server's (give url)")
    timeout, bound = table.get("timeout_s", timeout), table.get("max_result_chars", bound)
    _check_limits(timeout, bound, f"{where}: timeout_s", f"{where}: max_result_chars")
    auto = table.get("auto_approve", [])
    if not isinstance(auto, bool):
        auto = _strings(auto, f"{where}: auto_approve (true, or a list of tool names)", list)
    approve_all = auto is True or "*" in approved
    cwd = table.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError(f"{where}: cwd must be a directory")
    return ServerSpec(name, command=command, args=_strings(table.get("args", []), f"{where}: args", list),
                      env=_strings(table.get("env", {}), f"{where}: env", dict), cwd=cwd, url=url,
                      headers=_strings(table.get("headers", {}), f"{where}: headers", dict),
                      approve_all=approve_all, auto_approve=frozenset((() if isinstance(auto, bool) else auto))
                      | (approved - {"*"}), timeout_s=float(timeout), max_result_chars=bound)


def server_specs(settings: ToolSettings, table: Mapping[str, Any], given: Collection[str] = ()) -> tuple[ServerSpec, ...]:
    """The configured servers: settings.toml's `[mcp]` `table`, then --mcp's (which replace one of
    the same name). `given`: the flags given (Config.given), which win over `[mcp]`'s defaults.
    ValueError names the setting that is wrong."""
    unknown = set(table) - {"servers", "timeout_s", "max_result_chars"}
    if unknown:
        raise ValueError(f"settings.toml [mcp]: {', '.join(sorted(unknown))}: not an MCP setting "
                         "(servers, timeout_s, max_result_chars)")
    timeout = settings.mcp_timeout if "mcp_timeout" in given else table.get("timeout_s", settings.mcp_timeout)
    bound = settings.mcp_max_result if "mcp_max_result" in given else table.get("max_result_chars", settings.mcp_max_result)
    _check_limits(timeout, bound, "settings.toml [mcp] timeout_s", "settings.toml [mcp] max_result_chars")
    servers = table.get("servers", {})
    if not isinstance(servers, dict) or not all(isinstance(t, dict) for t in servers.values()):
        raise ValueError("settings.toml [mcp.servers]: each server is a table, [mcp.servers.NAME]")
    named = {n: (t, f"settings.toml [mcp.servers.{n}]") for n, t in servers.items()}
    named |= {n: (t, f"--mcp {n}") for n, t in flag_servers(settings.mcp)}
    approvals = _approvals(settings.mcp_auto_approve)
    stray = set(approvals) - set(named)
    if stray:
        raise ValueError(f"--mcp-auto-approve: no MCP server is named {', '.join(sorted(stray))}")
    return tuple(_spec(_check_name(n, where), t, timeout, bound, approvals.get(n, set()), where)
                 for n, (t, where) in named.items())
