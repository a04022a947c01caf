"""The Origin rule (web/origins.py) on the chat routes, over a real socket: a body is read as JSON
whatever its content type, as Ollama reads it (its documented `curl -d` sends a form type,
litellm's ollama_chat/ none), and a request whose Origin is another site's is a 403 in the
route's API's shape whatever its content type; the server's own pages, this machine's and the
listed origins pass. With raw `requests` and the `ollama` client."""
from __future__ import annotations

import json

import pytest
import requests

from .scripted_engine import ScriptedEngine, app_for, model, serve

ASK = [{"role": "user", "content": "Say hi."}]
ROUTES = {   # path: (a non-streamed body, the reply's text in the answer, the API's error shape)
    "/api/chat": ({"model": "m", "messages": ASK, "stream": False}, lambda a: a["message"]["content"], "ollama"),
    "/api/generate": ({"model": "m", "prompt": "Say hi.", "stream": False}, lambda a: a["response"], "ollama"),
    "/v1/chat/completions": ({"model": "m", "messages": ASK}, lambda a: a["choices"][0]["message"]["content"],
                             "openai"),
    "/v1/messages": ({"model": "m", "max_tokens": 16, "messages": ASK}, lambda a: a["content"][0]["text"],
                     "anthropic"),
}
FORM = "application/x-www-form-urlencoded"        # what `curl -d` sends
CONTENT_TYPES = [FORM, None, "text/plain", "multipart/form-data; boundary=x", "application/json"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("origins"))
    engine = ScriptedEngine(model("Qwen3-Coder", tmp))
    engine.reply = "Hi."
    with serve(app_for(engine, tmp, "origins")) as base:
        yield base


def post(url: str, path: str, ctype: str | None, origin: str | None = None, body: dict | None = None):
    """The body as JSON text under `ctype` (None: no Content-Type at all, as litellm sends it)."""
    headers = {k: v for k, v in (("Content-Type", ctype), ("Origin", origin)) if v is not None}
    return requests.post(url + path, data=json.dumps(body or ROUTES[path][0]).encode(), headers=headers, timeout=60)


@pytest.mark.parametrize("ctype", CONTENT_TYPES)
@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_body_is_read_as_json_whatever_its_content_type(url, path, ctype):
    r = post(url, path, ctype)
    assert r.request.headers.get("Content-Type") == ctype
    assert r.status_code == 200, r.text
    assert ROUTES[path][1](r.json()) == "Hi."


@pytest.mark.parametrize("ctype", CONTENT_TYPES)
@pytest.mark.parametrize("path", sorted(ROUTES))
def test_another_sites_origin_is_a_403_in_the_apis_shape(url, path, ctype):
    r = post(url, path, ctype, origin="http://evil.example")
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    err = r.json()
    shape = ROUTES[path][2]
    if shape == "ollama":
        message = err["error"]
    elif shape == "anthropic":
        assert err["type"] == "error" and err["error"]["type"] == "permission_error"
        message = err["error"]["message"]
    else:
        assert err["error"]["type"] == "permission_error" and err["error"]["code"] == "forbidden"
        message = err["error"]["message"]
    assert "http://evil.example" in message and "--cors-origins" in message


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_the_servers_own_pages_and_this_machines_pass(url, path):
    for origin in (url, "http://localhost:5173", "app://desktop-client"):   # url: the Host the page came from
        r = post(url, path, "application/json", origin=origin)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["Access-Control-Allow-Origin"] == origin


def test_a_preflight_from_another_site_is_a_403_and_from_this_machine_a_204(url):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    assert requests.options(url + "/api/chat", headers={**ask, "Origin": "http://evil.example"}).status_code == 403
    ok = requests.options(url + "/api/chat", headers={**ask, "Origin": "http://localhost:3000"})
    assert ok.status_code == 204 and ok.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


def test_ollamas_curl_line_streamed(url):
    """`curl http://localhost:11434/api/chat -d '{...}'`: a form type, NDJSON back."""
    body = {"model": "m", "messages": ASK}
    r = requests.post(url + "/api/chat", data=json.dumps(body), headers={"Content-Type": FORM}, timeout=60)
    lines = [json.loads(line) for line in r.text.splitlines() if line]
    assert r.status_code == 200 and lines[-1]["done"] is True
    assert "".join(line["message"]["content"] for line in lines) == "Hi."


def test_a_body_that_is_not_json_is_still_a_clear_400(url):
    r = requests.post(url + "/api/chat", data={"model": "m", "prompt": "hi"}, timeout=60)   # a real form
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_the_ollama_client(url):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=url, timeout=60)
    assert client.chat(model="m", messages=ASK)["message"]["content"] == "Hi."
    assert client.generate(model="m", prompt="Say hi.")["response"] == "Hi."
    evil = ollama.Client(host=url, timeout=60, headers={"Origin": "http://evil.example"})
    with pytest.raises(ollama.ResponseError) as ei:
        evil.chat(model="m", messages=ASK)
    assert ei.value.status_code == 403
