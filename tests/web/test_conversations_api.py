"""/api/conversations over Flask's test client: the lifecycle, search, a restart, and bad input,
which gets a 4xx in the API's error shape and changes nothing."""
from __future__ import annotations

import re

import pytest

from appliance.config import Config, ServerConfig
from web import create_app
from web.conversations import DEFAULTS


class NoPool:
    """The pool as far as these routes need it: no model loaded."""

    def client(self, *args, **kwargs):
        return None


def make_client(db_path):
    app = create_app(Config(server=ServerConfig(conversations_db=str(db_path))), NoPool())
    return app.test_client()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "conversations.db"


@pytest.fixture
def client(db_path):
    return make_client(db_path)


def ok(resp, status=200):
    assert resp.status_code == status, resp.get_data(as_text=True)
    return resp.get_json()


def error(resp, status=400, param=None):
    assert resp.status_code == status, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_lifecycle(client):
    created = ok(client.post("/api/conversations", json={
        "title": "  First  ", "settings": {"temperature": 0.3, "system": "be brief"},
        "messages": [{"role": "user", "content": "hi"}]}), 201)
    cid = created["id"]
    assert re.fullmatch(r"conv_[0-9a-f]{24}", cid) and created["object"] == "conversation"
    assert created["title"] == "First" and created["n_messages"] == 1
    assert created["settings"] == {**DEFAULTS, "temperature": 0.3, "system": "be brief"}
    assert list(created) == ["id", "object", "title", "created_at", "updated_at", "n_messages", "settings",
                             "messages"]
    assert ok(client.get(f"/api/conversations/{cid}")) == created

    answer = {"role": "assistant", "content": "hello", "reasoning_content": "greet back",
              "timings": {"predicted_n": 2}, "finish_reason": "stop"}
    appended = ok(client.post(f"/api/conversations/{cid}/messages", json={"messages": [answer]}))
    assert [m["content"] for m in appended["messages"]] == ["hi", "hello"]
    assert appended["messages"][1]["timings"] == {"predicted_n": 2}
    assert appended["updated_at"] >= created["updated_at"]

    # regenerate: drop the answer and put another in its place
    again = ok(client.post(f"/api/conversations/{cid}/messages",
                           json={"messages": [{**answer, "content": "hey"}], "from": 1}))
    assert [m["content"] for m in again["messages"]] == ["hi", "hey"]

    patched = ok(client.patch(f"/api/conversations/{cid}", json={
        "title": "Renamed", "settings": {"temperature": None, "seed": 7, "thinking": False}}))
    assert patched["title"] == "Renamed"
    assert patched["settings"] == {**DEFAULTS, "system": "be brief", "seed": 7, "thinking": False}
    assert patched["messages"] == again["messages"]

    listed = ok(client.get("/api/conversations"))
    assert listed["object"] == "list"
    assert listed["data"] == [{k: v for k, v in patched.items() if k != "messages"} | {"n_messages": 2}]

    gone = ok(client.delete(f"/api/conversations/{cid}"))
    assert gone == {"id": cid, "object": "conversation.deleted", "deleted": True}
    error(client.get(f"/api/conversations/{cid}"), 404)
    assert ok(client.get("/api/conversations"))["data"] == []


def test_defaults(client):
    c = ok(client.post("/api/conversations", json={}), 201)
    assert (c["title"], c["settings"], c["messages"], c["n_messages"]) == ("New conversation", DEFAULTS, [], 0)


def test_list_order_search_and_paging(client):
    ids = [ok(client.post("/api/conversations", json={"title": t}), 201)["id"] for t in ("a", "b_c", "50% off")]
    ok(client.post(f"/api/conversations/{ids[0]}/messages",
                   json={"messages": [{"role": "user", "content": "Tell me about ZEBRAS"}]}))

    def titles(query=""):
        return [c["title"] for c in ok(client.get("/api/conversations" + query))["data"]]

    assert titles() == ["a", "50% off", "b_c"]
    assert titles("?q=zebra") == ["a"]
    assert titles("?q=%25") == ["50% off"]
    assert titles("?q=_") == ["b_c"]
    assert titles("?q=nothing") == []
    assert titles("?limit=1&offset=1") == ["50% off"]
    for query, param in (("?limit=0", "limit"), ("?limit=1001", "limit"), ("?limit=x", "limit"),
                         ("?offset=-1", "offset")):
        error(client.get("/api/conversations" + query), 400, param)


def test_restart_sees_the_data(db_path):
    first = make_client(db_path)
    c = ok(first.post("/api/conversations", json={"title": "kept", "messages": [
        {"role": "user", "content": "remember me"}]}), 201)
    second = make_client(db_path)
    assert ok(second.get(f"/api/conversations/{c['id']}")) == c
    assert [x["id"] for x in ok(second.get("/api/conversations?q=remember"))["data"]] == [c["id"]]


def test_unknown_id(client):
    for resp in (client.get("/api/conversations/conv_nope"),
                 client.patch("/api/conversations/conv_nope", json={"title": "x"}),
                 client.delete("/api/conversations/conv_nope"),
                 client.post("/api/conversations/conv_nope/messages", json={"messages": []})):
        assert error(resp, 404)["message"] == "no conversation 'conv_nope'"
    assert ok(client.get("/api/conversations"))["data"] == []


def test_the_chosen_tools_are_a_setting(client):
    """settings.tools: the MCP tools a conversation gives the model, names as /api/tools gives
    them, each once; null is none again."""
    c = ok(client.post("/api/conversations", json={"settings": {"tools": ["calc__add", "web__fetch", "calc__add"]}}),
           201)
    assert c["settings"]["tools"] == ["calc__add", "web__fetch"]
    p = ok(client.patch(f"/api/conversations/{c['id']}", json={"settings": {"tools": ["calc__add"]}}))
    assert p["settings"]["tools"] == ["calc__add"]
    cleared = ok(client.patch(f"/api/conversations/{c['id']}", json={"settings": {"tools": None}}))
    assert cleared["settings"]["tools"] == [] == DEFAULTS["tools"]


BAD_CREATE = [
    ({"title": "x" * 201}, "title"),
    ({"title": "   "}, "title"),
    ({"title": 5}, "title"),
    ({"color": "red"}, "color"),
    ({"settings": []}, "settings"),
    ({"settings": {"temperature": 3}}, "settings.temperature"),
    ({"settings": {"temperature": "hot"}}, "settings.temperature"),
    ({"settings": {"top_p": 1.5}}, "settings.top_p"),
    ({"settings": {"max_tokens": 0}}, "settings.max_tokens"),
    ({"settings": {"max_tokens": 1.5}}, "settings.max_tokens"),
    ({"settings": {"seed": True}}, "settings.seed"),
    ({"settings": {"thinking": "yes"}}, "settings.thinking"),
    ({"settings": {"system": 1}}, "settings.system"),
    ({"settings": {"system": "x" * 200_001}}, "settings.system"),
    ({"settings": {"model": ""}}, "settings.model"),
    ({"settings": {"mood": "calm"}}, "settings.mood"),
    ({"settings": {"tools": "calc__add"}}, "settings.tools"),
    ({"settings": {"tools": [1]}}, "settings.tools"),
    ({"settings": {"tools": ["has space"]}}, "settings.tools"),
    ({"settings": {"tools": ["x" * 65]}}, "settings.tools"),
    ({"settings": {"tools": [f"t{i}" for i in range(129)]}}, "settings.tools"),
    ({"messages": {}}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi", "created_at": "now"}]}, "messages[0].created_at"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": {}}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": ["f"]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "images": "data:"}]}, "messages[0].images"),
    ({"messages": [{"role": "assistant", "content": "hi", "images": []}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["data:image/png;base64,aGk="]}]},
     "messages[0].images[0]"),                      # base64 of no picture: what the chat API refuses
    ({"messages": [{"role": "user", "content": "hi", "images": ["https://x/y.png"]}]}, "messages[0].images[0]"),
    ({"messages": [{"role": "tool", "content": "", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "", "timings": [1]}]}, "messages[0].timings"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": 1}]}, "messages[1].content"),
]


@pytest.fixture
def existing(client):
    """One conversation, and a function that says the store still holds exactly it."""
    c = ok(client.post("/api/conversations", json={"title": "keep", "settings": {"seed": 1},
                                                   "messages": [{"role": "user", "content": "a"}]}), 201)

    def unchanged():
        assert ok(client.get(f"/api/conversations/{c['id']}")) == c
        assert [x["id"] for x in ok(client.get("/api/conversations"))["data"]] == [c["id"]]

    return c, unchanged


@pytest.mark.parametrize("body,param", BAD_CREATE, ids=[p for _, p in BAD_CREATE])
def test_bad_create_changes_nothing(client, existing, body, param):
    error(client.post("/api/conversations", json=body), 400, param)
    existing[1]()


@pytest.mark.parametrize("body,param", [b for b in BAD_CREATE if not b[1].startswith("messages")]
                         + [({"messages": []}, "messages")], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_patch_changes_nothing(client, existing, body, param):
    c, unchanged = existing
    error(client.patch(f"/api/conversations/{c['id']}", json=body), 400, param)
    unchanged()


@pytest.mark.parametrize("body,param", [
    ({}, "messages"), ({"messages": None}, "messages"), ({"messages": [], "from": 2}, "from"),
    ({"messages": [], "from": -1}, "from"), ({"messages": [], "from": "0"}, "from"),
    ({"messages": [], "from": True}, "from"), ({"messages": [], "title": "x"}, "title"),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "x", "content": ""}], "from": 0}, "messages[1].role"),
])
def test_bad_messages_change_nothing(client, existing, body, param):
    c, unchanged = existing
    error(client.post(f"/api/conversations/{c['id']}/messages", json=body), 400, param)
    unchanged()


@pytest.mark.parametrize("method,url", [("post", "/api/conversations"), ("patch", "/api/conversations/{id}"),
                                        ("post", "/api/conversations/{id}/messages")])
def test_malformed_bodies_change_nothing(client, existing, method, url):
    c, unchanged = existing
    send = getattr(client, method)
    url = url.format(id=c["id"])
    error(send(url, data="{not json", content_type="application/json"), 400)
    error(send(url, data="[1, 2]", content_type="application/json"), 400)
    error(send(url, data=b"\xff\xfe", content_type="application/json"), 400)
    error(send(url, data="title=t", content_type="application/x-www-form-urlencoded"), 400)   # read as JSON
    error(send(url, json={"title": "t" * (10 * 1024 * 1024)}), 413)
    unchanged()


def test_unopenable_store_is_a_json_error(tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    client = make_client(tmp_path / "file" / "conversations.db")
    for resp in (client.get("/api/conversations"), client.post("/api/conversations", json={})):
        assert error(resp, 503)["code"] == "conversations_unavailable"


def test_a_picture_is_stored_with_its_message(client):
    from tests.engine.mmproj_fixture import picture
    import base64
    url = "data:image/png;base64," + base64.b64encode(picture(seed=1)).decode()
    c = ok(client.post("/api/conversations", json={"messages": [{"role": "user", "content": "what?",
                                                                 "images": [url]}]}), 201)
    assert ok(client.get(f"/api/conversations/{c['id']}"))["messages"][0]["images"] == [url]
