"""Security defaults and what a local client expects: an API key guards every route but
/health, which tells a monitor without it the status only (constant-time compare), and no data
(conversations, host report, results) is read or changed without it; a server without a key on
a network address says so loudly at start and in /health; CORS answers
pages served from this machine and listed origins, preflights without the key, and any other
Origin is a 403 (web/origins.py); the Host check
holds on every loopback address bound. The server also binds both loopbacks (where this host
has ::1) and runs a built-in chat template; the first tests need no server (Flask's client)."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import requests

from appliance.config import Config, ServerConfig, StoreConfig
from appliance.library.catalog import ModelSpec
from appliance.models import EMBEDDED_ALIAS
from appliance.store import ModelFingerprint, Store
from tests.engine.fake_runner import FakeRunner
from web import create_app
from web.server import announce

from .conftest import running_server

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


IPV6 = has_ipv6_loopback()


class Pool:
    """One loaded model, as /health and /v1/models read it."""

    default = "fake"
    engine = SimpleNamespace(info=dataclasses.replace(FakeRunner().info, chat_template_source="builtin:chatml"),
                             state=SimpleNamespace(pid=1, restarts=0, status="ready", reason=None), stats=None)

    def client(self, name=None):
        return self.engine

    def names(self):
        return [self.default]

    def spec(self, name):
        return ModelSpec(name, Path(name + ".gguf"), "file")

    def state_of(self, name):
        return "loaded"

    def status(self):
        return []

    def in_flight(self):
        return 0


def app_client(**server):
    cfg = ServerConfig(**{"api_key": KEY, "cors_origins": "http://allowed.example", **server})
    return create_app(Config(server=cfg), Pool()).test_client()


def test_health_tells_a_monitor_without_the_key_its_status_only():
    client = app_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/health", headers=headers)
        assert r.status_code == 200 and set(r.get_json()) == {"status", "uptime_s"} and r.get_json()["status"] == "ok"
    full = client.get("/health", headers=AUTH).get_json()
    assert full["model"] == "fake" and full["chat_template"] == {"source": "builtin:chatml", "from_model": False,
                                                                 "thinking_switch": False}
    assert client.get("/metrics").status_code == 401 and client.get("/v1/models").status_code == 401


def data_app(tmp_path):
    """An app with the key over a conversation, a saved host report and a stored run."""
    report = tmp_path / "host.json"
    report.write_text(json.dumps({"snapshot": {"taken_at": "2026-01-01T00:00:00+00:00"}, "advice": []}))
    with Store.open(tmp_path / "results.db") as store:
        store.start_run(["appliance", "sweep"], {}, ModelFingerprint("m.gguf", "0" * 64, "F32", 1))
    server = ServerConfig(api_key=KEY, conversations_db=str(tmp_path / "conversations.db"),
                          host_report=str(report))
    return create_app(Config(server=server, store=StoreConfig(db_path=str(tmp_path / "results.db"))), Pool())


def test_no_route_but_the_pages_and_health_answers_without_the_key(tmp_path):
    app = data_app(tmp_path)
    client = app.test_client()
    conv = client.post("/api/conversations", headers=AUTH, json={
        "title": "private", "messages": [{"role": "user", "content": "my secret"}]}).get_json()
    open_to_all = {"static", "api.health"}
    checked = 0
    for rule in app.url_map.iter_rules():
        if rule.endpoint in open_to_all or rule.endpoint.startswith("ui."):
            continue
        url = re.sub(r"<(?:(\w+):)?\w+>", lambda m: "1" if m[1] == "int" else conv["id"], rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = client.open(url, method=method, headers=headers, json={"title": "changed", "messages": []})
                assert r.status_code == 401, (method, url, headers, r.status_code)
                assert b"my secret" not in r.data
                checked += 1
    assert checked > 100
    assert client.get(f"/api/conversations/{conv['id']}", headers=AUTH).get_json() == conv   # nothing changed


def test_conversations_host_report_and_results_work_with_the_key(tmp_path):
    client = data_app(tmp_path).test_client()
    conv = client.post("/api/conversations", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}]})
    assert conv.status_code == 201
    cid, answer = conv.get_json()["id"], {"role": "assistant", "content": "yo"}
    for method, url, body in [
            ("GET", "/api/conversations", None), ("GET", "/api/conversations?q=hi", None),
            ("GET", f"/api/conversations/{cid}", None),
            ("POST", f"/api/conversations/{cid}/messages", {"messages": [answer]}),
            ("PATCH", f"/api/conversations/{cid}", {"title": "t"}), ("DELETE", f"/api/conversations/{cid}", None),
            ("GET", "/api/host", None), ("GET", "/api/bench/runs", None)]:
        assert client.open(url, method=method, headers=AUTH, json=body).status_code == 200, (method, url)
    assert client.get("/api/conversations?q=hi", headers=AUTH).get_json()["data"] == []       # deleted
    assert [r["id"] for r in client.get("/api/bench/runs", headers=AUTH).get_json()["runs"]] == [1]


@pytest.mark.parametrize("host,key,exposed", [("0.0.0.0", None, True), ("127.0.0.1,192.168.1.5", None, True),
                                              ("myhost.example", None, True), ("0.0.0.0", KEY, False),
                                              ("127.0.0.1,::1", None, False), ("localhost", None, False)])
def test_a_server_without_a_key_on_a_network_address_says_so(host, key, exposed, capsys, caplog):
    cfg = ServerConfig(host=host, api_key=key)
    health = create_app(Config(server=cfg), Pool()).test_client().get("/health", headers=AUTH).get_json()
    assert health["exposed"] is exposed and len(health["warnings"]) == exposed
    with caplog.at_level(logging.WARNING, logger="appliance.server"):
        announce("fake", "http://x:8080", cfg)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "appliance: serving fake at http://x:8080  (chat page at /, OpenAI API at /v1)"
    if exposed:
        (warning,) = health["warnings"]
        assert out[1:] == [f"appliance: WARNING: {warning}"] and caplog.messages == [warning]
        assert f"--host {host}" in warning and "conversations" in warning and "host report" in warning
        assert "--api-key" in warning and "127.0.0.1" in warning
    else:
        assert out[1:] == [] and caplog.messages == []


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost:5173", True), ("http://127.0.0.1:3000", True), ("https://[::1]:8443", True),
    ("http://localhost", True), ("http://0.0.0.0:8080", True), ("http://allowed.example", True),
    ("app://obsidian.md", True), ("tauri://localhost", True), ("file://", True),
    ("chrome-extension://abcdef", True), ("vscode-webview://x", True),   # Ollama's defaults
    ("http://evil.example", False), ("http://localhost.evil.example", False), ("http://127.0.0.1.nip.io", False),
    ("null", False), ("http://localhost:5173.evil.example", False),
])
def test_cors_allows_pages_from_this_machine_and_listed_origins(origin, allowed):
    client = app_client()
    pre = client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    got = client.get("/v1/models", headers={**AUTH, "Origin": origin})
    if allowed:    # the preflight needs no key; the SDK's own headers are allowed
        assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == origin
        assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
        assert got.headers["Access-Control-Allow-Origin"] == origin
    else:          # refused outright, with or without the key (web/origins.py)
        for r in (pre, got):
            assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
            assert r.get_json()["error"]["type"] == "permission_error" and origin in r.get_json()["error"]["message"]


@pytest.mark.parametrize("listed,origin,allowed", [
    ("*", "http://anywhere.example", True), ("https://*.example.com", "https://chat.example.com", True),
    ("https://*.example.com", "https://example.org", False), ("HTTP://Allowed.Example/", "http://allowed.example", True),
    ("", "http://allowed.example", False)])
def test_cors_origins_lists_origins_a_star_and_patterns(listed, origin, allowed):
    r = app_client(cors_origins=listed).get("/v1/models", headers={**AUTH, "Origin": origin})
    assert r.status_code == (200 if allowed else 403)
    assert r.headers.get("Access-Control-Allow-Origin") == (origin if allowed else None)


@pytest.mark.parametrize("host", ["127.0.0.1,::1", "0.0.0.0"])
def test_a_page_of_the_servers_own_origin_is_allowed_under_any_name_the_host_check_allows(host):
    """The chat page posts with its own origin, http(s):// + the Host it was loaded from; a
    rebound name (evil.example resolving to 127.0.0.1) is refused by the Host check first on a
    loopback server."""
    client = app_client(host=host, cors_origins="")
    for name in ("localhost:8080", "127.0.0.1:8080"):
        for scheme in ("http", "https"):
            r = client.get("/v1/models", headers={**AUTH, "Host": name, "Origin": f"{scheme}://{name}"})
            assert r.status_code == 200
    lan = client.get("/v1/models", headers={**AUTH, "Host": "192.168.1.5:8080", "Origin": "http://192.168.1.5:8080"})
    assert lan.status_code == (200 if host == "0.0.0.0" else 403)   # a LAN name: only where it is bound
    rebound = client.get("/v1/models", headers={**AUTH, "Host": "evil.example:8080", "Origin": "http://evil.example:8080"})
    assert rebound.status_code == (403 if host != "0.0.0.0" else 200)
    other = client.get("/v1/models", headers={**AUTH, "Host": "192.168.1.5:8080", "Origin": "http://evil.example"})
    assert other.status_code == 403


@pytest.mark.parametrize("host,checked", [("127.0.0.1,::1", True), ("localhost", True), ("0.0.0.0", False),
                                          ("127.0.0.1,0.0.0.0", False)])
def test_the_host_check_holds_when_every_bound_address_is_loopback(host, checked):
    client = app_client(host=host)
    for local in ("localhost:8080", "127.0.0.1", "[::1]:8080"):
        assert client.get("/v1/models", headers={**AUTH, "Host": local}).status_code == 200
    foreign = client.get("/v1/models", headers={**AUTH, "Host": "evil.example:8080"})
    assert foreign.status_code == (403 if checked else 200)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("sec"), "--n-ctx", "256", "--n-slots", "1",
                        "--host", "127.0.0.1,::1" if IPV6 else "127.0.0.1", "--chat-template", "chatml",
                        "--api-key", KEY, "--cors-origins", "http://allowed.example", health_headers=AUTH) as srv:
        yield srv


def test_health_answers_without_the_key_and_the_api_does_not(server):
    r = requests.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and "model" not in r.json()
    assert requests.get(server.url + "/health", headers=AUTH).json()["chat_template"]["source"] == "builtin:chatml"
    assert requests.get(server.url + "/v1/models").status_code == 401


@pytest.mark.parametrize("path", ["/metrics", "/v1/models", "/openapi.json", "/api/conversations",
                                  "/api/host", "/api/bench/runs"])
def test_every_route_needs_the_key(server, path):
    assert requests.get(server.url + path).status_code == 401
    assert requests.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(server.url + path, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/", "/host", "/bench", "/static/app/common.js"])
def test_pages_are_served_without_the_key_and_carry_no_data(server, path):
    # the page asks for the key itself and sends it on each API call
    r = requests.get(server.url + path)
    assert r.status_code == 200
    assert "SmolLM2" not in r.text and "n_ctx" not in r.text


@pytest.mark.parametrize("path,body", [("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_tokenizer_routes_need_the_key(server, path, body):
    assert requests.post(server.url + path, json=body).status_code == 401
    assert requests.post(server.url + path, json=body, headers=AUTH).status_code == 200


def test_openai_client_with_and_without_the_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model=good.models.list().data[0].id, max_tokens=3,
                                     messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message is not None


def test_cors_for_local_pages_and_listed_origins(server):
    ok = requests.get(server.url + "/v1/models", headers={**AUTH, "Origin": "http://allowed.example"})
    assert ok.headers.get("Access-Control-Allow-Origin") == "http://allowed.example"
    for origin in ("http://allowed.example", "http://localhost:5173"):
        pre = requests.options(server.url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204 and pre.headers.get("Access-Control-Allow-Origin") == origin
        assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    other = requests.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 403 and "Access-Control-Allow-Origin" not in other.headers


@pytest.mark.skipif(not IPV6, reason="this host has no IPv6 loopback")
def test_both_loopbacks_answer_and_keep_the_host_check(server):
    port = server.url.rsplit(":", 1)[1]
    for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
        assert requests.get(base + "/v1/models", headers=AUTH).status_code == 200
        assert base in server.log()              # the start-up line names every address
    assert requests.get(f"http://[::1]:{port}/v1/models", headers={**AUTH, "Host": "evil.example"}).status_code == 403


def test_a_fixed_model_name_gets_the_served_model_under_the_builtin_template(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="gpt-4o-mini", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert r.model == EMBEDDED_ALIAS                  # the id of the model that answered
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # SmolLM2's own adds a system turn
    ids = requests.post(server.url + "/tokenize", headers=AUTH, json={"content": chatml, "add_special": True}).json()
    assert r.usage.prompt_tokens == len(ids["tokens"])


def test_anthropic_clients_send_the_key_as_x_api_key(server):
    body = {"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["type"] == "message"
