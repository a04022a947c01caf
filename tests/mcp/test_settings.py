"""The MCP servers' configuration: settings.toml's [mcp] table and the --mcp flags, what each
gives, which wins, and the mistakes refused with the setting named."""
from __future__ import annotations

import pytest

from appliance import config
from appliance.mcp.settings import ServerSpec, read_table, server_specs

TOML = """
["SmolLM2-135M-Instruct"]
n_ctx = 4096

[mcp]
timeout_s = 12
max_result_chars = 5000

[mcp.servers.calc]
command = "python3"
args = ["-m", "calc", "--digits=3"]
env = { CALC_DIGITS = "10" }
cwd = "/srv/calc"
auto_approve = ["add"]
timeout_s = 4

[mcp.servers.search]
url = "https://search.example/mcp"
headers = { Authorization = "Bearer T" }
auto_approve = true
"""


def specs(flags: dict | None = None, table: dict | None = None, env: dict | None = None) -> dict[str, ServerSpec]:
    cfg = config.load(flags or {}, env or {})
    return {s.name: s for s in server_specs(cfg.server, table or {}, cfg.given)}


def test_settings_toml_gives_stdio_and_http_servers(tmp_path):
    (tmp_path / "settings.toml").write_text(TOML)
    got = specs(table=read_table(tmp_path))
    calc, search = got["calc"], got["search"]
    assert (calc.transport, calc.command, calc.args, calc.env, calc.cwd) == (
        "stdio", "python3", ("-m", "calc", "--digits=3"), (("CALC_DIGITS", "10"),), "/srv/calc")
    assert (calc.timeout_s, calc.max_result_chars) == (4.0, 5000)       # its own, then [mcp]'s
    assert calc.approves("add") and not calc.approves("sub")
    assert (search.transport, search.url, search.headers) == ("http", "https://search.example/mcp",
                                                              (("Authorization", "Bearer T"),))
    assert search.approves("anything") and search.timeout_s == 12.0
    # the models' settings are read as before, without the [mcp] table
    from appliance.library.catalog import load_settings

    assert load_settings(tmp_path) == {"SmolLM2-135M-Instruct": {"n_ctx": 4096}}


def test_no_file_no_servers(tmp_path):
    assert read_table(tmp_path) == {} and specs() == {}


def test_flags_give_servers_and_win_over_the_tables_defaults(tmp_path):
    (tmp_path / "settings.toml").write_text(TOML)
    got = specs({"mcp": ["calc=uvx calc-server --fast", "web=http://127.0.0.1:9000/mcp"],
                 "mcp_auto_approve": "web.fetch,calc.*", "mcp_timeout": "7", "mcp_max_result": "300"},
                table=read_table(tmp_path))
    assert set(got) == {"calc", "search", "web"}
    calc = got["calc"]   # --mcp calc replaces the file's calc
    assert (calc.command, calc.args, calc.env, calc.approve_all) == ("uvx", ("calc-server", "--fast"), (), True)
    assert (calc.timeout_s, calc.max_result_chars) == (7.0, 300)   # the flag, over [mcp]'s
    assert got["web"].url == "http://127.0.0.1:9000/mcp" and got["web"].approves("fetch")
    assert not got["web"].approves("other")
    assert got["search"].timeout_s == 7.0


def test_the_environment_gives_them_too():
    got = specs(env={"APPLIANCE_MCP": "a=http://h:1/mcp,b=./server.py --x", "APPLIANCE_MCP_TIMEOUT": "2.5"})
    assert got["a"].url == "http://h:1/mcp" and got["b"].args == ("--x",) and got["b"].timeout_s == 2.5


@pytest.mark.parametrize("flags, message", [
    ({"mcp": ["calc"]}, "give NAME=URL or NAME=COMMAND ARGS"),
    ({"mcp": ["=python3 x.py"]}, "the server name ''"),
    ({"mcp": ["a__b=python3"]}, "the server name 'a__b'"),
    ({"mcp": ["bad name=python3"]}, "the server name 'bad name'"),
    ({"mcp": ["calc='unclosed"]}, "No closing quotation"),
    ({"mcp_timeout": "0"}, "--mcp-timeout must be a positive number"),
    ({"mcp_max_result": "10"}, "--mcp-max-result must be a whole number of characters, at least 256"),
    ({"mcp_auto_approve": "calc"}, "give SERVER.TOOL or SERVER.*"),
])
def test_bad_flags_are_refused_at_start(flags, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace(".", r"\.")):
        config.load(flags, {})


@pytest.mark.parametrize("server, message", [
    ({}, "give command (a stdio server) or url (streamable HTTP), one of them"),
    ({"command": "x", "url": "http://h/mcp"}, "one of them"),
    ({"url": "ftp://h/mcp"}, "url must be an http:// or https:// address"),
    ({"url": "http://h/mcp", "args": ["x"]}, "args, env and cwd are a stdio server's"),
    ({"command": "x", "headers": {"A": "b"}}, "headers are an HTTP server's"),
    ({"command": "x", "args": "one string"}, "args must be a list of strings"),
    ({"command": "x", "env": {"N": 1}}, "env must be a table of strings"),
    ({"command": "x", "auto_approve": "add"}, "auto_approve (true, or a list of tool names)"),
    ({"command": "x", "timeout_s": -1}, "timeout_s must be a positive number"),
    ({"command": "x", "max_result_chars": 1.5}, "max_result_chars must be a whole number"),
    ({"command": "x", "shell": True}, "shell: not a server setting"),
    ({"command": ""}, "command must be a program to run"),
])
def test_bad_server_tables_are_refused_with_their_name(server, message):
    with pytest.raises(ValueError, match=r"\[mcp\.servers\.calc\]") as e:
        specs(table={"servers": {"calc": server}})
    assert message in str(e.value)


def test_bad_mcp_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\[mcp\]: retries: not an MCP setting"):
        specs(table={"retries": 3})
    with pytest.raises(ValueError, match=r"each server is a table"):
        specs(table={"servers": {"calc": "python3"}})
    with pytest.raises(ValueError, match="no MCP server is named ghost"):
        specs({"mcp_auto_approve": "ghost.add"})
    (tmp_path / "settings.toml").write_text("[mcp\n")
    with pytest.raises(ValueError, match="settings.toml"):
        read_table(tmp_path)
    (tmp_path / "settings.toml").write_text("mcp = 3\n")
    with pytest.raises(ValueError, match=r"\[mcp\] must be a table"):
        read_table(tmp_path)
