"""Branches, export and import over /api/conversations with Flask's test client: regenerate and edit
keep the old messages as siblings, select moves between them, a reply is replaced in place, and an
exported file imports as the same conversation while a bad one is a 400 that writes nothing."""
from __future__ import annotations

import base64
import json

import pytest

from .test_conversations_api import error, make_client, ok


@pytest.fixture
def client(tmp_path):
    return make_client(tmp_path / "conversations.db")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text, "finish_reason": "stop"}


def shown(conv: dict) -> list[tuple[str, str]]:
    """Each message of the path shown and its `< i/n >`."""
    return [(m["content"], f"{m['sibling_index'] + 1}/{m['n_siblings']}") for m in conv["messages"]]


def branched(client) -> dict:
    """q1 -> a1 | a2 (regenerated through `from`), and under a2 q2 -> b1 (added under a parent)."""
    c = ok(client.post("/api/conversations", json={"title": "branches", "settings": {"seed": 5},
                                                   "messages": [user("q1"), reply("a1")]}), 201)
    c = ok(client.post(f"/api/conversations/{c['id']}/messages", json={"messages": [reply("a2")], "from": 1}))
    return ok(client.post(f"/api/conversations/{c['id']}/messages",
                          json={"messages": [user("q2"), reply("b1")], "parent": c["messages"][1]["id"]}))


def test_regenerate_edit_and_select(client):
    c = branched(client)
    cid = c["id"]
    assert shown(c) == [("q1", "1/1"), ("a2", "2/2"), ("q2", "1/1"), ("b1", "1/1")] and c["n_messages"] == 4
    a1, a2 = c["messages"][1]["siblings"]
    assert c["messages"][1]["id"] == a2 and c["messages"][2]["parent_id"] == a2
    old = ok(client.post(f"/api/conversations/{cid}/select", json={"message_id": a1}))
    assert shown(old) == [("q1", "1/1"), ("a1", "1/2")]
    assert ok(client.get(f"/api/conversations/{cid}")) == old                          # remembered
    assert ok(client.get("/api/conversations"))["data"][0]["n_messages"] == 2
    back = ok(client.post(f"/api/conversations/{cid}/select", json={"message_id": a2}))
    assert shown(back) == shown(c)
    # edit the first question: a sibling root
    edited = ok(client.post(f"/api/conversations/{cid}/messages", json={"messages": [user("q1?")], "from": 0}))
    assert shown(edited) == [("q1?", "2/2")]
    # a reply continued is replaced in place, not branched
    ok(client.post(f"/api/conversations/{cid}/select", json={"message_id": a2}))
    b1 = c["messages"][3]["id"]
    grown = ok(client.put(f"/api/conversations/{cid}/messages/{b1}",
                          json={**reply("b1 and more"), "finish_reason": "length", "timings": {"predicted_n": 3}}))
    assert shown(grown)[-1] == ("b1 and more", "1/1") and grown["messages"][-1]["id"] == b1
    assert grown["messages"][-1]["timings"] == {"predicted_n": 3}


@pytest.mark.parametrize("method,url,body,status,param", [
    ("post", "/select", {"message_id": "msg_nope"}, 404, "message_id"),
    ("post", "/select", {}, 400, "message_id"),
    ("post", "/select", {"message_id": 3}, 400, "message_id"),
    ("post", "/select", {"message_id": "m", "x": 1}, 400, "x"),
    ("post", "/messages", {"messages": [user("x")], "parent": "msg_nope"}, 400, "parent"),
    ("post", "/messages", {"messages": [user("x")], "parent": 7}, 400, "parent"),
    ("post", "/messages", {"messages": [user("x")], "parent": "P", "from": 1}, 400, "parent"),
    ("put", "/messages/msg_nope", reply("x"), 404, "message_id"),
    ("put", "/messages/{a1}", {"role": "assistant"}, 400, "message.content"),
    ("put", "/messages/{a1}", {**reply("x"), "id": "msg_x"}, 400, "message.id"),
])
def test_bad_branch_requests_change_nothing(client, method, url, body, status, param):
    c = branched(client)
    before = ok(client.get(f"/api/conversations/{c['id']}"))
    tree = ok(client.get(f"/api/conversations/{c['id']}/export"))["messages"]
    if "parent" in body and body["parent"] == "P":
        body = {**body, "parent": c["messages"][0]["id"]}
    url = url.format(a1=c["messages"][1]["siblings"][0])
    error(getattr(client, method)(f"/api/conversations/{c['id']}{url}", json=body), status, param)
    assert ok(client.get(f"/api/conversations/{c['id']}")) == before
    assert ok(client.get(f"/api/conversations/{c['id']}/export"))["messages"] == tree


def picture_uri() -> str:
    from tests.engine.mmproj_fixture import picture
    return "data:image/png;base64," + base64.b64encode(picture(seed=2)).decode()


def test_export_then_import_gives_the_same_conversation(client):
    c = branched(client)
    pic = picture_uri()
    ok(client.post(f"/api/conversations/{c['id']}/messages",
                   json={"messages": [{**user("and this?"), "images": [pic]}], "parent": c["messages"][1]["siblings"][0]}))
    ok(client.post(f"/api/conversations/{c['id']}/select", json={"message_id": c["messages"][1]["id"]}))
    resp = client.get(f"/api/conversations/{c['id']}/export")
    assert resp.headers["Content-Disposition"] == 'attachment; filename="branches.json"'
    doc = ok(resp)
    assert (doc["format"], doc["version"], doc["title"], doc["settings"]) == ("appliance.conversation", 1,
                                                                              "branches", {"seed": 5})
    made = ok(client.post("/api/conversations/import", data=json.dumps(doc), content_type="application/json"), 201)
    original = ok(client.get(f"/api/conversations/{c['id']}"))
    assert made["id"] != c["id"] and made["title"] == "branches" and made["settings"] == original["settings"]
    assert shown(made) == shown(original)
    again = ok(client.get(f"/api/conversations/{made['id']}/export"))
    strip = [{k: v for k, v in m.items() if k not in ("id", "parent_id")} for m in doc["messages"]]
    assert [{k: v for k, v in m.items() if k not in ("id", "parent_id")} for m in again["messages"]] == strip
    assert [m["images"] for m in again["messages"] if m["images"]] == [[pic]]
    assert len(ok(client.get("/api/conversations"))["data"]) == 2


def spoil_message(field, value):
    return lambda d: d["messages"][0].update({field: value})


BAD_IMPORTS = [
    (lambda d: d.update(format="chatgpt"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.pop("messages"), "messages"),
    (lambda d: d["messages"][2].update(parent_id="msg_unknown"), "messages[2].parent_id"),
    (lambda d: d["messages"][1].update(id=d["messages"][0]["id"]), "messages[1].id"),
    (lambda d: d.update(current="msg_unknown"), "current"),
    (lambda d: d.update(title=""), "title"),
    (lambda d: d.update(settings={"temperature": 9}), "settings.temperature"),
    (lambda d: d.update(settings={"colour": "red"}), "settings.colour"),
    (spoil_message("role", "robot"), "messages[0].role"),
    (spoil_message("content", None), "messages[0].content"),
    (spoil_message("images", ["data:image/png;base64,aGk="]), "messages[0].images[0]"),
    (lambda d: d["messages"][-1].update(images=["https://example.com/a.png"]), "messages[4].images"),
]


@pytest.mark.parametrize("spoil,param", BAD_IMPORTS, ids=[p for _, p in BAD_IMPORTS])
def test_a_bad_import_is_a_400_and_writes_nothing(client, spoil, param):
    c = branched(client)
    doc = ok(client.get(f"/api/conversations/{c['id']}/export"))
    spoil(doc)
    error(client.post("/api/conversations/import", json=doc), 400, param)
    assert [x["id"] for x in ok(client.get("/api/conversations"))["data"]] == [c["id"]]


def test_import_refuses_what_is_not_a_file(client):
    for data in ("{not json", "[1]", '"text"'):
        error(client.post("/api/conversations/import", data=data, content_type="application/json"), 400)
    assert ok(client.get("/api/conversations"))["data"] == []
    error(client.get("/api/conversations/conv_nope/export"), 404)
