"""Security defaults: an API key guards every route (constant-time compare), CORS answers only
listed origins."""
from __future__ import annotations

import openai
import pytest
import requests

from .conftest import running_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("sec"), "--n-ctx", "256", "--n-slots", "1",
                        "--api-key", KEY, "--cors-origins", "http://allowed.example",
                        health_headers={"Authorization": f"Bearer {KEY}"}) as srv:
        yield srv


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/openapi.json", "/api/conversations",
                                  "/api/host", "/api/bench/runs"])
def test_every_route_needs_the_key(server, path):
    assert requests.get(server.url + path).status_code == 401
    assert requests.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("path", ["/", "/host", "/bench", "/static/app/common.js"])
def test_pages_are_served_without_the_key_and_carry_no_data(server, path):
    # the page asks for the key itself and sends it on each API call
    r = requests.get(server.url + path)
    assert r.status_code == 200
    assert "SmolLM2" not in r.text and "n_ctx" not in r.text


@pytest.mark.parametrize("path,body", [("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_tokenizer_routes_need_the_key(server, path, body):
    assert requests.post(server.url + path, json=body).status_code == 401
    assert requests.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_openai_client_with_and_without_the_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model=good.models.list().data[0].id, max_tokens=3,
                                     messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message is not None


def test_cors_only_for_listed_origins(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = requests.get(server.url + "/v1/models", headers={**auth, "Origin": "http://allowed.example"})
    assert ok.headers.get("Access-Control-Allow-Origin") == "http://allowed.example"
    other = requests.get(server.url + "/v1/models", headers={**auth, "Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers
    pre = requests.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://allowed.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers.get("Access-Control-Allow-Origin") == "http://allowed.example"


def test_anthropic_clients_send_the_key_as_x_api_key(server):
    body = {"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["type"] == "message"
