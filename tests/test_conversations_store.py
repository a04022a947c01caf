"""The conversations store on its own: CRUD, order, search, branches (the tree, switching, the
migration from the old list schema), export and import, migrations, reopen."""
from __future__ import annotations

import re
import sqlite3
import threading

import pytest

from appliance.conversations import ConversationStore, ConversationsUnavailable
from appliance.errors import InvalidRequest, NotFound


class Clock:
    """Strictly increasing timestamps, so the order of updates is the order of calls."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"2025-01-01T00:00:{self.n:02d}.000+00:00"


@pytest.fixture
def path(tmp_path):
    return tmp_path / "sub" / "dir" / "conversations.db"  # the directories do not exist yet


@pytest.fixture
def store(path):
    return ConversationStore.open(path, clock=Clock())


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_create_and_get(store):
    assistant = {"role": "assistant", "content": "", "reasoning_content": "hmm",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                 "timings": {"predicted_per_second": 12.5}, "finish_reason": "tool_calls"}
    c = store.create("Title", {"temperature": 0.2}, [user("hi"), assistant])
    assert re.fullmatch(r"conv_[0-9a-f]{24}", c["id"])
    assert (c["title"], c["settings"], c["n_messages"]) == ("Title", {"temperature": 0.2}, 2)
    assert c["created_at"] == c["updated_at"] == "2025-01-01T00:00:01.000+00:00"
    m0, m1 = c["messages"]
    assert re.fullmatch(r"msg_[0-9a-f]{24}", m0["id"]) and m0["id"] != m1["id"]
    assert m0 == {"id": m0["id"], "parent_id": None, **user("hi"), "reasoning_content": None, "tool_calls": None,
                  "tool_call_id": None, "timings": None, "finish_reason": None, "images": None,
                  "documents": None, "created_at": c["created_at"], "siblings": [m0["id"]], "sibling_index": 0, "n_siblings": 1}
    assert m1 == {"id": m1["id"], "parent_id": m0["id"], **assistant, "tool_call_id": None, "images": None,
                  "documents": None, "created_at": c["created_at"], "siblings": [m1["id"]], "sibling_index": 0, "n_siblings": 1}
    assert store.get(c["id"]) == c


def test_ids_are_unique_and_defaults(store):
    a, b = store.create(), store.create()
    assert a["id"] != b["id"]
    assert (a["title"], a["settings"], a["messages"]) == ("New conversation", {}, [])


def test_unknown_id(store):
    for call in (lambda: store.get("conv_x"), lambda: store.update("conv_x", "t"),
                 lambda: store.delete("conv_x"), lambda: store.put_messages("conv_x", [user("a")])):
        with pytest.raises(NotFound, match="no conversation 'conv_x'"):
            call()
    assert store.summaries() == []


def test_update_merges_settings_and_bumps(store):
    c = store.create("a", {"temperature": 0.2, "seed": 1})
    u = store.update(c["id"], settings={"seed": None, "top_p": 0.5})
    assert u["settings"] == {"temperature": 0.2, "top_p": 0.5}
    assert u["title"] == "a" and u["updated_at"] > c["updated_at"] and u["created_at"] == c["created_at"]
    assert store.update(c["id"], title="b")["title"] == "b"
    assert store.get(c["id"])["settings"] == {"temperature": 0.2, "top_p": 0.5}


def test_put_messages_append_branch_and_range(store):
    c = store.create(messages=[user("0"), user("1"), user("2")])
    assert [m["content"] for m in store.put_messages(c["id"], [user("3")])["messages"]] == ["0", "1", "2", "3"]
    after = store.put_messages(c["id"], [user("x"), user("y")], start=1)
    assert [m["content"] for m in after["messages"]] == ["0", "x", "y"] and after["n_messages"] == 3
    assert after["messages"][1]["n_siblings"] == 2 and after["messages"][1]["sibling_index"] == 1  # "1" is kept
    assert [m["content"] for m in store.put_messages(c["id"], [], start=3)["messages"]] == ["0", "x", "y"]
    before = store.get(c["id"])
    for bad in (-1, 4):
        with pytest.raises(InvalidRequest, match="between 0 and 3"):
            store.put_messages(c["id"], [user("no")], start=bad)
    assert store.get(c["id"]) == before
    assert store.put_messages(c["id"], [], start=0)["messages"] == []        # nothing shown, nothing lost
    assert store.summaries()[0]["n_messages"] == 0
    assert [m["content"] for m in store.export(c["id"])["messages"]] == ["0", "1", "2", "3", "x", "y"]


def test_summaries_order_paging_and_counts(store):
    a = store.create("a")
    store.create("b")
    store.create("c")
    store.put_messages(a["id"], [user("m")])  # a is now the most recently updated
    rows = store.summaries()
    assert [r["title"] for r in rows] == ["a", "c", "b"]
    assert rows[0]["n_messages"] == 1 and "messages" not in rows[0]
    assert [r["title"] for r in store.summaries(limit=1, offset=1)] == ["c"]
    assert store.summaries(offset=3) == []


def test_search_titles_and_contents_ignoring_case_and_wildcards(store):
    a = store.create("Report 100% done", messages=[user("nothing")])
    b = store.create("plain", messages=[user("snake_case and ÉCOLE")])
    store.create("other", messages=[user("100 percent, snakeXcase")])

    def found(q):
        return {r["id"] for r in store.summaries(q)}

    assert found("report") == {a["id"]}
    assert found("0%") == {a["id"]}            # % is a character, not a wildcard
    assert found("e_c") == {b["id"]}           # and so is _
    assert found("école") == {b["id"]}         # case folded beyond ASCII
    assert found("\\") == set()
    assert found("zzz") == set()
    assert len(store.summaries("")) == 3


def test_delete_removes_messages(store, path):
    c = store.create(messages=[user("a"), user("b")])
    keep = store.create(messages=[user("c")])
    store.delete(c["id"])
    with pytest.raises(NotFound):
        store.get(c["id"])
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT conversation_id FROM messages").fetchall() == [(keep["id"],)]


def test_reopen_keeps_data_and_applies_migrations_once(path):
    first = ConversationStore.open(path)
    c = first.create("kept", {"system": "be brief"}, [user("hello")])
    second = ConversationStore.open(path)
    assert second.get(c["id"]) == c
    with sqlite3.connect(path) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM _migrations")]
        assert names == ["0001_conversations_messages", "0002_message_images", "0003_message_tree",
                         "0004_message_documents"]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_threads_share_one_store(store):
    c = store.create()

    def write(k):
        for i in range(20):
            store.put_messages(c["id"], [user(f"{k}-{i}")])
            store.summaries("x")

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get(c["id"])["n_messages"] == 80


def test_unopenable_path_is_a_typed_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConversationsUnavailable):
        ConversationStore.open(tmp_path / "file" / "conversations.db")
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConversationsUnavailable):
        ConversationStore.open(tmp_path / "junk.db")


def test_a_user_messages_pictures_are_kept_in_order(store):
    pics = ["data:image/png;base64,AAAA", "data:image/jpeg;base64,BBBB"]
    c = store.create("Pictures", {}, [{**user("what is this?"), "images": pics}])
    assert store.get(c["id"])["messages"][0]["images"] == pics


def test_a_user_messages_documents_are_kept(store):
    docs = [{"name": "a.pdf", "kind": "pdf", "pages": 2, "tokens": 40, "content": "File: a.pdf (PDF, 2 pages)\n```\nx\n```"}]
    c = store.create("Documents", {}, [{**user("read it"), "documents": docs}])
    assert store.get(c["id"])["messages"][0]["documents"] == docs


def test_a_database_from_before_documents_is_migrated_with_its_messages(path):
    c = ConversationStore.open(path).create("old", {}, [user("hello")])
    with sqlite3.connect(path) as conn:   # as the store left it before 0004: no documents column
        conn.execute("ALTER TABLE messages DROP COLUMN documents")
        conn.execute("DELETE FROM _migrations WHERE name = '0004_message_documents'")
    reopened = ConversationStore.open(path).get(c["id"])
    assert reopened["messages"] == [{**c["messages"][0], "documents": None}]
