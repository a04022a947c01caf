"""/api/tools over Flask's test client, with a hub on the toy MCP server (tests/mcp/toy_server.py)
over stdio: the servers and their tools with schemas, a server that failed, a call run at once,
the refusals, no servers at all, and with --api-key only a keyed request lists or runs tools."""
from __future__ import annotations

import pytest

from appliance.config import Config, ServerConfig
from appliance.mcp.hub import ToolHub
from appliance.mcp.settings import ServerSpec
from web import create_app

from ..mcp.toy import stdio_spec

KEY = "sekrit"


class NoPool:
    def client(self, *args, **kwargs):
        return None

    def engine_pids(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def hub():
    h = ToolHub([stdio_spec(timeout_s=3, max_result_chars=500, auto_approve=frozenset({"add"})),
                 ServerSpec("broken", command="/nonexistent/mcp-server", timeout_s=3)])
    h.status(wait_s=120)     # connected, however loaded the machine
    yield h
    h.close()


def client_of(tmp_path, hub, api_key=None):
    cfg = Config(server=ServerConfig(conversations_db=str(tmp_path / "c.db"), api_key=api_key))
    return create_app(cfg, NoPool(), hub).test_client()


def test_lists_the_servers_their_state_and_their_tools(tmp_path, hub):
    body = client_of(tmp_path, hub).get("/api/tools").get_json()
    servers = {s["name"]: s for s in body["servers"]}
    assert body["object"] == "list" and set(servers) == {"toy", "broken"}
    assert servers["broken"]["state"] == "failed" and "No such file" in servers["broken"]["error"]
    assert servers["broken"]["tools"] == [] and servers["broken"]["transport"] == "stdio"
    toy = servers["toy"]
    assert (toy["state"], toy["error"], toy["transport"]) == ("ready", None, "stdio")
    add = next(t for t in toy["tools"] if t["tool"] == "add")
    assert add == {"name": "toy__add", "server": "toy", "tool": "add", "description": "Add two numbers.",
                   "input_schema": add["input_schema"], "auto_approve": True}
    assert add["input_schema"]["properties"]["b"]["type"] == "number"
    assert not next(t for t in toy["tools"] if t["tool"] == "hang")["auto_approve"]
    assert body["data"] == toy["tools"]


def test_a_call_runs_the_tool_and_answers_its_result(tmp_path, hub):
    c = client_of(tmp_path, hub)
    r = c.post("/api/tools/call", json={"name": "toy__add", "arguments": {"a": 1.5, "b": 2}})
    assert r.status_code == 200 and r.get_json() | {"seconds": 0} == {
        "ok": True, "text": "3.5", "truncated": False, "error": None, "seconds": 0}
    huge = c.post("/api/tools/call", json={"name": "toy__huge", "arguments": {"n": 2000}}).get_json()
    assert huge["truncated"] and len(huge["text"]) == 500
    hung = c.post("/api/tools/call", json={"name": "toy__hang"}).get_json()
    assert hung["ok"] is False and hung["error"] == "timed out after 3 s"


@pytest.mark.parametrize("body, status, param", [
    ({"name": "toy__nope"}, 404, None),
    ({"name": "broken__x"}, 404, None),
    ({}, 400, "name"),
    ({"name": 3}, 400, "name"),
    ({"name": "toy__add", "arguments": [1, 2]}, 400, "arguments"),
    ({"name": "toy__add", "server": "elsewhere"}, 400, "server"),
])
def test_bad_calls_are_refused(tmp_path, hub, body, status, param):
    r = client_of(tmp_path, hub).post("/api/tools/call", json=body)
    assert r.status_code == status, r.get_data(as_text=True)
    if param:
        assert r.get_json()["error"]["param"] == param


def test_without_servers_the_lists_are_empty_and_a_call_is_a_404(tmp_path):
    c = client_of(tmp_path, None)
    assert c.get("/api/tools").get_json() == {"object": "list", "servers": [], "data": []}
    assert c.post("/api/tools/call", json={"name": "toy__add"}).status_code == 404


def test_with_an_api_key_only_keyed_requests_list_or_run_tools(tmp_path, hub):
    c = client_of(tmp_path, hub, api_key=KEY)
    assert c.get("/api/tools").status_code == 401
    assert c.post("/api/tools/call", json={"name": "toy__add", "arguments": {"a": 1, "b": 1}}).status_code == 401
    assert c.get("/api/tools", headers={"Authorization": "Bearer wrong"}).status_code == 401
    keyed = {"Authorization": f"Bearer {KEY}"}
    assert c.get("/api/tools", headers=keyed).get_json()["data"]
    r = c.post("/api/tools/call", json={"name": "toy__add", "arguments": {"a": 1, "b": 1}}, headers=keyed)
    assert r.get_json()["text"] == "2"
    c.set_cookie("appliance_key", KEY)    # the page's keyed session
    assert c.get("/api/tools").status_code == 200
