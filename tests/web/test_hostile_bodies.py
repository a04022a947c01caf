"""Bodies no client should send: every one is a 4xx in its API's error shape (OpenAI's on /v1/*,
llama-server's routes and the appliance's own; Anthropic's on /v1/messages; Ollama's on /api/chat
and the rest of its routes), and the next request is served. Flask's test client over a pool
whose engine refuses every call with a 503: a body that reaches it passed validation."""
from __future__ import annotations

import json
import re

import llguidance
import pytest

from appliance.config import Config, ServerConfig
from appliance.engine.chat import ChatTemplate
from appliance.engine.output.constraints import _grammar
from appliance.chat_templates import load_template
from appliance.engine import chat_formats
from appliance.engine.types import ChatMessage, ToolCall
from appliance.errors import EngineUnavailable, InvalidRequest
from tests.engine.fake_runner import FakeRunner
from web import create_app
from web.wire import MAX_JSON_DEPTH, parse_chat

MODEL = "fake"
REACHED = "the request reached the engine"
USER = [{"role": "user", "content": "hi"}]


class Engine:
    """A loaded model whose every call is a 503: a body gets this far only once it is valid."""

    info = FakeRunner().info
    lora = None   # as EngineClient's before any POST /lora-adapters: the flags' scales

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-1"

    def _reached(self, *args, **kwargs):
        raise EngineUnavailable(REACHED)

    submit = embed = tokenize = tokenize_many = detokenize = render_prompt = _reached


class Pool:
    """One chat model that also embeds, always loaded."""

    default = MODEL
    engine = Engine()

    def resolve(self, name=None, exact=False):
        return MODEL

    resolve_embedding = resolve

    def kind(self, name):
        return "chat"

    def acquire(self, name, keep_alive=None):
        return self.engine

    def release(self, name):
        pass

    def client(self, name=None):
        return self.engine

    load = client

    def state_of(self, name):
        return "loaded"

    def engine_pids(self):
        return {}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile") / "conversations.db"
    return create_app(Config(server=ServerConfig(conversations_db=str(db))), Pool())


@pytest.fixture(scope="module")
def routes(app):
    """Every route that reads a body, its variables filled in (a conversation that exists)."""
    client = app.test_client()
    cid = client.post("/api/conversations", json={"title": "t"}).get_json()["id"]
    return [(method, rule.rule.replace("<conv_id>", cid).replace("<id_slot>", "0"), rule.endpoint.split(".")[0])
            for rule in app.url_map.iter_rules()
            for method in sorted(rule.methods & {"POST", "PUT", "PATCH"})]


def refused(resp, family: str) -> str:
    """The message of a 400 in `family`'s error shape."""
    assert resp.status_code == 400, resp.get_data(as_text=True)[:300]
    body = resp.get_json()
    if family == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    if family == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]["message"]


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


DEEP = '{"messages": ' + nested(100_000) + "}"
HOSTILE = {
    "deep": (DEEP, "nests deeper than"),
    "only brackets": ("[" * 100_000, "nests deeper than"),
    "just past the limit": ('{"a": ' + nested(MAX_JSON_DEPTH) + "}", f"nests deeper than {MAX_JSON_DEPTH} levels"),
    "long integer": ('{"max_tokens": ' + "9" * 5000 + "}", "has an integer of more than"),
    "NaN": ('{"settings": {"temperature": NaN}}', "has NaN, which is not a JSON number"),
    "Infinity": ('{"keep_alive": -Infinity}', "has -Infinity, which is not a JSON number"),
    "past a float": ('{"messages": [{"content": 1e999}]}', "has 1e999, a number past the largest float"),
}


@pytest.mark.parametrize("raw,says", HOSTILE.values(), ids=HOSTILE)
def test_every_route_refuses_a_hostile_body_in_its_apis_shape_and_serves_the_next(app, routes, raw, says):
    client = app.test_client()
    for method, path, family in routes:
        resp = client.open(path, method=method, data=raw, content_type="application/json")
        assert says in refused(resp, family), (method, path)
        after = client.post("/v1/chat/completions", json={"messages": USER})
        assert after.status_code == 503 and after.get_json()["error"]["message"] == REACHED


def test_the_depth_limit_is_exact(app):
    chat = {"messages": USER, "metadata": json.loads(nested(MAX_JSON_DEPTH - 1))}   # the body is one more level
    assert parse_chat(chat, "c", {MODEL}, 2048).model == MODEL
    client = app.test_client()
    assert client.post("/v1/chat/completions", json=chat).status_code == 503
    chat["metadata"] = [chat["metadata"]]
    assert "nests deeper" in refused(client.post("/v1/chat/completions", json=chat), "api")


def test_tool_call_arguments_nested_too_deep_are_refused_by_name():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    with pytest.raises(InvalidRequest) as ei:
        parse_chat({"messages": [*USER, {"role": "assistant", "tool_calls": [call]}]}, "c", {MODEL}, 2048)
    assert ei.value.param == "messages[1].tool_calls[0].function.arguments"
    assert f"nests deeper than {MAX_JSON_DEPTH} levels" in ei.value.message


# -- what the engine does with the deepest structure a body may hold ----------------------------

def schema(depth: int) -> dict:
    """A JSON schema nesting `depth` levels, or one fewer (each property takes two)."""
    s: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        s = {"type": "object", "properties": {"a": s}}
    return s


def test_the_deepest_schema_and_arguments_render_and_compile_to_a_400_not_a_crash():
    deep = schema(MAX_JSON_DEPTH)
    args = json.dumps({"a": json.loads(nested(MAX_JSON_DEPTH - 2))})
    tool = {"type": "function", "function": {"name": "f", "description": "", "parameters": deep}}
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", None, tool_calls=(ToolCall("c", "f", args),))]
    for name in ("llama3", "chatml", "mistral"):   # tojson, with and without indent
        assert ChatTemplate(load_template(name)[1]).render(messages, tools=[tool])
    # llguidance refuses a schema this deep with an error (a 400 at submit), never a stack overflow
    compiled = [_grammar("json_schema", json.dumps(deep)),
                llguidance.LLMatcher.grammar_from_lark(chat_formats.Generic().grammar(
                    chat_formats.Context(tools={"f": deep}, parallel=False), "required"))]
    assert all(llguidance.LLMatcher.validate_grammar(g) for g in compiled)


def test_a_gbnf_grammar_nested_too_deep_is_a_400():
    with pytest.raises(InvalidRequest) as ei:
        _grammar("gbnf", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000)
    assert ei.value.param == "grammar" and "nests too deeply" in ei.value.message
    assert _grammar("gbnf", 'root ::= "a"')  # an ordinary one still compiles


# -- an error nobody expected ------------------------------------------------------------------

def all_routes(app) -> list[tuple[str, str, str]]:
    """Every route and method, any path variable filled with "1"."""
    return [(method, re.sub(r"<[^>]+>", "1", rule.rule), rule.endpoint)
            for rule in app.url_map.iter_rules() for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]


def test_an_unexpected_exception_is_a_500_in_its_apis_shape_and_the_next_is_served(app, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("a bug; its text is not for clients")

    for endpoint in list(app.view_functions):
        monkeypatch.setitem(app.view_functions, endpoint, boom)
    client = app.test_client()
    for method, path, endpoint in all_routes(app):
        resp = client.open(path, method=method, json={})
        assert resp.status_code == 500, (method, path)
        body, family = resp.get_json(), endpoint.split(".")[0]
        if family == "anthropic":
            assert body == {"type": "error", "error": {"type": "api_error", "message": "internal server error"}}
        elif family == "ollama":
            assert body == {"error": "internal server error"}, (method, path)
        else:   # OpenAI's, the Responses API's and llama-server's routes included
            assert body["error"]["type"] == "server_error" and body["error"]["message"] == "internal server error"
        assert "a bug" not in resp.get_data(as_text=True)
    monkeypatch.undo()
    # the same app serves on: each API's next request gets as far as the engine
    assert client.get("/api/version").status_code == 200
    resp = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": USER})
    assert resp.status_code == 503 and resp.get_json()["error"] == {"type": "overloaded_error", "message": REACHED}
    assert client.post("/api/chat", json={"model": MODEL, "messages": USER}).get_json() == {"error": REACHED}
    assert client.post("/v1/chat/completions", json={"messages": USER}).get_json()["error"]["message"] == REACHED


def test_a_server_side_http_error_stays_a_5xx(app, monkeypatch):
    from werkzeug.exceptions import ServiceUnavailable, abort

    def unavailable(*args, **kwargs):
        raise ServiceUnavailable("the backend is down")

    def plain_500(*args, **kwargs):
        abort(500)

    client = app.test_client()
    monkeypatch.setitem(app.view_functions, "api.models", unavailable)
    resp = client.get("/v1/models")
    assert resp.status_code == 503 and resp.get_json()["error"]["type"] == "server_error"
    monkeypatch.setitem(app.view_functions, "api.models", plain_500)
    assert client.get("/v1/models").status_code == 500


def test_a_bug_after_the_status_line_ends_the_stream_with_an_error_event(app):
    from web import serving
    from appliance.engine.types import Delta

    class Stream:
        id, aborted = "req-1", False

        def get(self, timeout=None):
            return Delta("req-1", "hi", (1,))

        def abort(self):
            self.aborted = True

    class Writer:
        def start(self): return b"start\n"
        def delta(self, ev): raise KeyError("a bug in a writer")
        def end(self, done): return b"end\n"
        def error(self, e): return f"error {e.status} {e.message}\n".encode()
        def idle(self): return b""

    class Tally:
        def delta(self, ev): pass
        def done(self, ev): pass

    sub = serving.Submitted(parsed=None, stream=Stream(), gone=lambda: False, fingerprint="", accepted=None)
    with app.app_context():
        out = b"".join(serving.stream(sub, Writer(), Tally(), keepalive=0))
    assert out == b"start\nerror 500 internal server error\n" and sub.stream.aborted
