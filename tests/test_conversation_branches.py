"""Branches in the conversations store: edits and regenerations kept as siblings, moving between
them, a message updated in place, the migration of a database made with the list schema, and
export / import (the whole tree round trip, and files refused whole)."""
from __future__ import annotations

import copy
import json
import sqlite3

import pytest
import sqlite_utils

from appliance import conversation_export
from appliance.conversations import MIGRATIONS, ConversationStore
from appliance.errors import InvalidRequest, NotFound

from .test_conversations_store import Clock, user


@pytest.fixture
def store(tmp_path):
    return ConversationStore.open(tmp_path / "conversations.db", clock=Clock())


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text, "finish_reason": "stop"}


def contents(conv: dict) -> list[str]:
    return [m["content"] for m in conv["messages"]]


def places(conv: dict) -> list[tuple[int, int]]:
    """(index, count) among its siblings of each message shown: the page's `< 2/3 >`."""
    return [(m["sibling_index"] + 1, m["n_siblings"]) for m in conv["messages"]]


def branched(store) -> tuple[dict, dict]:
    """q1 -> a1 | a2 (regenerated), then q2 under a2 with its answer b1; returns (conv, ids)."""
    c = store.create("t", {}, [user("q1"), reply("a1")])
    q1, a1 = (m["id"] for m in c["messages"])
    c = store.put_messages(c["id"], [reply("a2")], start=1)           # regenerate: a sibling of a1
    a2 = c["messages"][1]["id"]
    c = store.add_messages(c["id"], a2, [user("q2"), reply("b1")])
    return c, {"q1": q1, "a1": a1, "a2": a2, "q2": c["messages"][2]["id"], "b1": c["messages"][3]["id"]}


def test_regenerate_and_edit_keep_the_old_ones_as_siblings(store):
    c, ids = branched(store)
    assert contents(c) == ["q1", "a2", "q2", "b1"] and places(c) == [(1, 1), (2, 2), (1, 1), (1, 1)]
    assert c["messages"][1]["siblings"] == [ids["a1"], ids["a2"]]
    assert c["messages"][2]["parent_id"] == ids["a2"] and c["n_messages"] == 4
    # edit the first question: a second root, answered on its own branch
    edited = store.put_messages(c["id"], [user("q1 edited")], start=0)
    edited = store.add_messages(c["id"], edited["messages"][0]["id"], [reply("c1")])
    assert contents(edited) == ["q1 edited", "c1"] and places(edited) == [(2, 2), (1, 1)]
    assert store.get(c["id"]) == edited and store.summaries()[0]["n_messages"] == 2


def test_select_follows_the_latest_leaf_and_changes_nothing_else(store):
    c, ids = branched(store)
    back = store.select(c["id"], ids["q1"])                 # the root: its latest leaf is b1
    assert contents(back) == ["q1", "a2", "q2", "b1"]
    first = store.select(c["id"], ids["a1"])
    assert contents(first) == ["q1", "a1"] and places(first) == [(1, 1), (1, 2)]
    assert first["updated_at"] == c["updated_at"]            # a view, not an edit
    assert store.get(c["id"]) == first                      # remembered
    assert contents(store.select(c["id"], ids["a2"])) == ["q1", "a2", "q2", "b1"]
    # a newer leaf under a2's branch is the one a2 now leads to
    store.select(c["id"], ids["q2"])
    newer = store.put_messages(c["id"], [reply("b2")], start=3)
    store.select(c["id"], ids["a1"])
    assert contents(store.select(c["id"], ids["a2"])) == ["q1", "a2", "q2", "b2"] == contents(newer)


def test_unknown_messages_are_refused_and_change_nothing(store):
    c, ids = branched(store)
    other = store.create("other", {}, [user("elsewhere")])
    before = store.get(c["id"])
    with pytest.raises(NotFound, match="no message 'msg_nope'"):
        store.select(c["id"], "msg_nope")
    with pytest.raises(NotFound):
        store.select(c["id"], other["messages"][0]["id"])    # another conversation's message
    with pytest.raises(InvalidRequest, match="no message 'msg_nope'"):
        store.add_messages(c["id"], "msg_nope", [user("x")])
    with pytest.raises(NotFound):
        store.update_message(c["id"], "msg_nope", {"content": "x"})
    assert store.get(c["id"]) == before


def test_update_message_changes_only_the_fields_given(store):
    c, ids = branched(store)
    u = store.update_message(c["id"], ids["b1"], {"content": "b1, continued", "finish_reason": "length",
                                                  "timings": {"predicted_n": 9}})
    last = u["messages"][-1]
    assert (last["id"], last["content"], last["finish_reason"], last["timings"]) == (
        ids["b1"], "b1, continued", "length", {"predicted_n": 9})
    assert last["role"] == "assistant" and u["updated_at"] > c["updated_at"] and len(u["messages"]) == 4


def test_add_messages_at_the_root_and_with_none(store):
    c = store.create()
    one = store.add_messages(c["id"], None, [user("a")])
    two = store.add_messages(c["id"], None, [user("b")])
    assert contents(one) == ["a"] and contents(two) == ["b"] and places(two) == [(2, 2)]
    assert contents(store.add_messages(c["id"], one["messages"][0]["id"], [])) == ["a"]   # select, in effect


def old_database(path):
    """A file as the list schema left it: the store's own migrations up to 0002, then rows."""
    db = sqlite_utils.Database(path)
    MIGRATIONS.apply(db, stop_before="0003_message_tree")
    db.conn.executescript("""
        INSERT INTO conversations VALUES ('conv_a', 'A', '{"seed": 3}', 't0', 't2'),
                                         ('conv_b', 'B', '{}', 't1', 't1'), ('conv_e', 'E', '{}', 't3', 't3');
        INSERT INTO messages (conversation_id, position, role, content, reasoning_content, tool_calls, tool_call_id,
                              timings, finish_reason, created_at, images)
            VALUES ('conv_a', 1, 'assistant', 'a1', 'hmm', NULL, NULL, '{"predicted_n": 2}', 'stop', 't1', NULL),
                   ('conv_a', 0, 'user', 'q1', NULL, NULL, NULL, NULL, NULL, 't0', '["data:image/png;base64,AAAA"]'),
                   ('conv_a', 2, 'user', 'q2', NULL, NULL, NULL, NULL, NULL, 't2', NULL),
                   ('conv_b', 0, 'user', 'only', NULL, NULL, NULL, NULL, NULL, 't1', NULL);
    """)
    db.conn.close()
    assert [r[0] for r in sqlite3.connect(path).execute("SELECT name FROM _migrations")] == [
        "0001_conversations_messages", "0002_message_images"]


def test_migration_turns_each_list_into_one_branch(tmp_path):
    path = tmp_path / "old.db"
    old_database(path)
    store = ConversationStore.open(path)
    a = store.get("conv_a")
    assert contents(a) == ["q1", "a1", "q2"] and places(a) == [(1, 1)] * 3 and a["n_messages"] == 3
    assert [m["parent_id"] for m in a["messages"]] == [None, a["messages"][0]["id"], a["messages"][1]["id"]]
    assert a["messages"][0]["images"] == ["data:image/png;base64,AAAA"]
    assert (a["messages"][1]["reasoning_content"], a["messages"][1]["timings"]) == ("hmm", {"predicted_n": 2})
    assert (a["settings"], a["updated_at"], a["messages"][2]["created_at"]) == ({"seed": 3}, "t2", "t2")
    assert contents(store.get("conv_b")) == ["only"] and store.get("conv_e")["messages"] == []
    assert [s["n_messages"] for s in store.summaries()] == [0, 3, 1]
    # and it branches like any other
    assert places(store.put_messages("conv_a", [reply("a1 again")], start=1)) == [(1, 1), (2, 2)]
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "messages_linear" not in tables
    store.delete("conv_a")                                   # the cascade still holds
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM messages WHERE conversation_id = 'conv_a'").fetchone() == (0,)


def shape(conv_export: dict) -> list[tuple]:
    """A tree without its ids: each message's fields and its parent's index."""
    index = {m["id"]: i for i, m in enumerate(conv_export["messages"])}
    return [(None if m["parent_id"] is None else index[m["parent_id"]],
             {k: v for k, v in m.items() if k not in ("id", "parent_id")}) for m in conv_export["messages"]]


def test_export_then_import_is_the_same_conversation(store):
    c, ids = branched(store)
    store.update(c["id"], settings={"temperature": 0.1, "system": "be brief"})
    pic = {**user("look"), "images": ["data:image/png;base64,AAAA"]}
    store.add_messages(c["id"], ids["a1"], [pic])
    store.select(c["id"], ids["a2"])
    doc = store.export(c["id"])
    assert (doc["format"], doc["version"], len(doc["messages"])) == ("appliance.conversation", 1, 6)
    doc = json.loads(json.dumps(doc))                         # through a file
    checked = conversation_export.check(doc)
    made = store.import_conversation(checked, doc["title"], doc["settings"])
    assert made["id"] != c["id"] and made["settings"] == {"temperature": 0.1, "system": "be brief"}
    assert contents(made) == contents(store.get(c["id"])) and places(made) == places(store.get(c["id"]))
    again = store.export(made["id"])
    assert shape(again) == shape(doc)                         # every branch, every field, every picture
    assert not {m["id"] for m in again["messages"]} & {m["id"] for m in doc["messages"]}   # new ids
    assert contents(store.select(made["id"], again["messages"][1]["id"])) == ["q1", "a1", "look"]


BAD = [
    (lambda d: d.update(format="something.else"), "format"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d.update(messages={}), "messages"),
    (lambda d: d.update(created_at="yesterday"), "created_at"),
    (lambda d: d.update(current="msg_elsewhere"), "current"),
    (lambda d: d["messages"].append("hi"), "messages[5]"),
    (lambda d: d["messages"][1].update(id=d["messages"][0]["id"]), "messages[1].id"),
    (lambda d: d["messages"][1].update(id=""), "messages[1].id"),
    (lambda d: d["messages"][1].update(id=5), "messages[1].id"),
    (lambda d: d["messages"][1].update(parent_id="msg_later"), "messages[1].parent_id"),
    (lambda d: d["messages"].reverse(), "messages[0].parent_id"),                 # a child before its parent
    (lambda d: d["messages"][0].update(parent_id=d["messages"][0]["id"]), "messages[0].parent_id"),   # a loop
    (lambda d: d["messages"][2].update(siblings=[]), "messages[2].siblings"),
    (lambda d: d["messages"][2].update(created_at=12), "messages[2].created_at"),
]


@pytest.mark.parametrize("spoil,param", BAD, ids=[p for _, p in BAD])
def test_a_bad_file_is_refused_whole(store, spoil, param):
    c, _ = branched(store)
    doc = store.export(c["id"])
    bad = copy.deepcopy(doc)
    spoil(bad)
    with pytest.raises(InvalidRequest) as e:
        conversation_export.check(bad)
    assert e.value.param == param and "not a conversation this appliance can import" in str(e.value)
    conversation_export.check(doc)                           # the unspoilt file is fine
    assert [s["id"] for s in store.summaries()] == [c["id"]]
    with pytest.raises(InvalidRequest):
        conversation_export.check([doc])
