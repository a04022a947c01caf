"""Branches and export / import on the chat page in a real browser (headless Chromium driven by
Playwright) against a real server on the embedded model: editing a question and regenerating a
reply keep the old ones, `< 1/2 >` moves between them (and the server remembers where), and a
conversation exported to a .json file and imported again is the same conversation."""
from __future__ import annotations

import base64
import json

import pytest
import requests

from .browser import browser_page, needs_browser
from .conftest import running_server
from .test_ui_browser import ask, conversations, greedy, settle

pytestmark = needs_browser


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ui-branches"), "--n-ctx", "1024", "--n-slots", "1") as srv:
        yield srv


def stored(server, conv_id: str) -> dict:
    return requests.get(f"{server.url}/api/conversations/{conv_id}", timeout=10).json()


def branch_labels(page) -> list[str]:
    """The `< i/n >` of each turn shown, '' where a message has no siblings."""
    return page.evaluate("[...document.querySelectorAll('#log .turn')].map("
                         "t => t.querySelector('.branches')?.dataset.branch || '')")


def wait_labels(page, labels: list[str]) -> None:
    page.wait_for_function("""(want) => JSON.stringify([...document.querySelectorAll('#log .turn')].map(
        t => t.querySelector('.branches')?.dataset.branch || '')) === JSON.stringify(want)""", arg=labels)


def test_edit_and_regenerate_keep_branches_and_the_page_moves_between_them(server):
    with browser_page(server, "chat-branches") as page:
        sent = []     # what the page has the server send the model: each reply's job request
        page.on("request", lambda r: r.method == "POST" and r.url.endswith("/jobs")
                and sent.append(json.loads(r.post_data)["request"]))
        page.goto(server.url + "/")
        greedy(page, max_tokens=8)
        ask(page, "Name a colour.")
        conv_id = page.evaluate("location.hash.slice(1)")
        first = stored(server, conv_id)["messages"]
        first_text = page.locator(".msg.assistant .content").inner_text()
        assert branch_labels(page) == ["", ""]
        # regenerate: the old reply stays, as 1/2
        page.click(".turn.assistant .regenerate")
        wait_labels(page, ["", "2/2"])
        settle(page)
        again = stored(server, conv_id)["messages"]
        assert again[1]["siblings"] == [first[1]["id"], again[1]["id"]] and again[1]["id"] != first[1]["id"]
        page.click(".turn.assistant .prevbranch")
        wait_labels(page, ["", "1/2"])
        assert stored(server, conv_id)["messages"][1]["id"] == first[1]["id"]     # the server follows
        assert page.locator(".msg.assistant .content").inner_text() == first_text
        page.click(".turn.assistant .nextbranch")
        wait_labels(page, ["", "2/2"])
        # edit the question: a new branch from the first message on, the old one kept
        page.click(".turn.user .edit")
        page.fill(".editbox", "Name a fruit.")
        page.click(".turn.user .save")
        wait_labels(page, ["2/2", ""])
        page.wait_for_selector(".turn.assistant .stats")
        settle(page)
        assert page.locator(".msg.user").all_inner_texts() == ["Name a fruit."]
        page.click(".turn.user .prevbranch")
        wait_labels(page, ["1/2", "2/2"])                       # the old question, with its latest reply
        assert page.locator(".msg.user").all_inner_texts() == ["Name a colour."]
        assert page.locator(".msg.assistant .content").inner_text() == first_text      # greedy: a2 reads as a1
        # the server remembers the branch shown: a reload shows it
        page.reload()
        wait_labels(page, ["1/2", "2/2"])
        assert page.locator(".msg.user").all_inner_texts() == ["Name a colour."]
        page.click(".turn.user .nextbranch")
        wait_labels(page, ["2/2", ""])
        assert page.locator(".msg.user").all_inner_texts() == ["Name a fruit."]
        # what goes to the model is the path shown: a turn here sends the fruit question, not the colour one
        ask(page, "Another one?")
        path = stored(server, conv_id)["messages"]
        assert [m["content"] for m in path[::2]] == ["Name a fruit.", "Another one?"]
        asked = [m["content"] for m in sent[-1]["messages"]]
        assert asked[:3] == [m["content"] for m in path[:3]] and not any("colour" in c for c in asked)
        assert len(sent) == 4
        assert not page.console, page.console


def without_ids(doc: dict) -> list[dict]:
    """A file's messages with their ids replaced by indexes, so two files compare."""
    index = {m["id"]: i for i, m in enumerate(doc["messages"])}
    return [{**m, "id": i, "parent_id": index.get(m["parent_id"])} for i, m in enumerate(doc["messages"])]


def test_export_then_import_gives_the_same_conversation_and_a_bad_file_is_refused(server, tmp_path):
    from ..engine.mmproj_fixture import picture

    pic = "data:image/png;base64," + base64.b64encode(picture(seed=3)).decode()
    made = requests.post(server.url + "/api/conversations", json={
        "title": "Exported", "settings": {"temperature": 0.2, "system": "Be brief."}, "messages": [
            {"role": "user", "content": "What is this?", "images": [pic]},
            {"role": "assistant", "content": "A **picture**.", "finish_reason": "stop"}]}, timeout=10).json()
    requests.post(f"{server.url}/api/conversations/{made['id']}/messages", json={
        "messages": [{"role": "assistant", "content": "Some pixels.", "finish_reason": "stop"}], "from": 1}, timeout=10)
    before = [c["id"] for c in conversations(server)]
    with browser_page(server, "chat-export-import") as page:
        page.goto(server.url + "/#" + made["id"])
        wait_labels(page, ["", "2/2"])
        with page.expect_download() as info:
            page.click("#export")
        download = info.value
        assert download.suggested_filename == "Exported.json"
        path = tmp_path / "exported.json"
        download.save_as(path)
        doc = json.loads(path.read_text())
        served = requests.get(f"{server.url}/api/conversations/{made['id']}/export", timeout=10).json()
        assert without_ids(doc) == without_ids(served) and len(doc["messages"]) == 3
        assert doc["messages"][0]["images"] == [pic]
        # import it: a new conversation, opened, the same as the first
        page.set_input_files("#import-file", str(path))
        page.wait_for_function("location.hash.slice(1) !== '%s' && location.hash.length > 1" % made["id"])
        new_id = page.evaluate("location.hash.slice(1)")
        wait_labels(page, ["", "2/2"])
        assert page.locator("#title").inner_text() == "Exported"
        assert page.locator(".msg.user img.thumb").get_attribute("src") == pic
        assert page.locator(".msg.assistant .content").inner_text() == "Some pixels."
        page.click(".turn.assistant .prevbranch")
        wait_labels(page, ["", "1/2"])
        assert page.locator(".msg.assistant strong").inner_text() == "picture"
        again = requests.get(f"{server.url}/api/conversations/{new_id}/export", timeout=10).json()
        assert without_ids(again) == without_ids(doc) and again["settings"] == doc["settings"]
        page.wait_for_function(f"document.querySelectorAll('#convs .conv').length == {len(before) + 1}")
        # a bad file: the server's reason is shown and nothing is written
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**doc, "version": 99}))
        page.set_input_files("#import-file", str(bad))
        page.wait_for_selector(".msg.error")
        assert "bad.json was not imported" in page.inner_text(".msg.error") and "version" in page.inner_text(".msg.error")
        assert len(conversations(server)) == len(before) + 1
        assert [m for m in page.console if "400" not in m] == []
