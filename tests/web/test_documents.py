"""Documents attached to a chat message: the reading and framing (web/document_text.py), the
route that reads and counts them (POST /api/documents) on a real server over the embedded
model, their storage with the message, and the chat page attaching them in Chromium."""
from __future__ import annotations

import base64
import json

import pytest
import requests

from web import document_text
from web.document_text import Document

from .browser import browser_page, needs_browser
from .conftest import running_server
from .pdf_fixtures import make_pdf
from .test_conversations_api import error, make_client, ok
from .test_ui_browser import greedy

MAX_BODY = 256 * 1024
N_CTX = 2048


def data_uri(raw: bytes, media_type: str = "application/octet-stream") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


# -- reading and framing -----------------------------------------------------------------------------

def test_the_fence_is_longer_than_any_run_of_backticks_in_the_text():
    assert document_text.frame(Document("a.md", "text", None, "plain\n")) == "File: a.md\n```\nplain\n```"
    framed = document_text.frame(Document("b.md", "text", None, "x ```` y"))
    assert framed.splitlines()[1] == "`````" and framed.endswith("\n`````")
    assert document_text.frame(Document("r.pdf", "pdf", 1, "t")).startswith("File: r.pdf (PDF, 1 page)\n")
    assert document_text.frame(Document("r.pdf", "pdf", 3, "t")).startswith("File: r.pdf (PDF, 3 pages)\n")


def test_text_is_decoded_by_its_bom_or_its_charset_and_otherwise_must_be_utf8():
    assert document_text.read("u.txt", "café\n".encode("utf-16")).text == "café\n"
    assert document_text.read("u.txt", "café".encode("utf-8-sig")).text == "café"
    assert document_text.read("l.txt", "café".encode("latin-1"), "text/plain", "iso-8859-1").text == "café"
    with pytest.raises(Exception, match=r"l.txt is not valid utf-8 text: byte 0xe9 at offset 3"):
        document_text.read("l.txt", "café".encode("latin-1"))
    with pytest.raises(Exception, match="unknown charset 'klingon'"):
        document_text.read("l.txt", b"abc", "text/plain", "klingon")
    with pytest.raises(Exception, match="holds binary bytes"):
        document_text.read("p.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")


def test_a_pdf_gives_its_pages_text_and_a_scan_or_a_fake_is_refused():
    doc = document_text.read("two.pdf", make_pdf(["First page (one).", "Second page."]))
    assert (doc.kind, doc.pages) == ("pdf", 2)
    assert "First page (one)." in doc.text and doc.text.index("First") < doc.text.index("Second page.")
    with pytest.raises(Exception, match=r"scan.pdf has no text layer \(2 pages"):
        document_text.read("scan.pdf", make_pdf([None, None]))
    with pytest.raises(Exception, match="fake.pdf is not a PDF"):
        document_text.read("fake.pdf", b"hello, I am text")
    with pytest.raises(Exception, match="broken.pdf is not a PDF this server can read"):
        document_text.read("broken.pdf", b"%PDF-1.4\n garbage with no objects")


# -- the route, on a real server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("docs"), "--n-ctx", str(N_CTX), "--n-slots", "1",
                        "--max-body-bytes", str(MAX_BODY), timeout=600) as srv:   # 2 cores, shared
        yield srv


def post(server, **body) -> requests.Response:
    return requests.post(server.url + "/api/documents", json=body, timeout=60)


def n_tokens(server, text: str) -> int:
    r = requests.post(server.url + "/tokenize", json={"content": text, "add_special": False}, timeout=30)
    return len(r.json()["tokens"])


def test_a_pdf_is_read_framed_and_counted_in_the_models_tokens(server):
    r = post(server, name="report.pdf", data=data_uri(make_pdf(["Quarterly revenue rose.", "Costs fell."]),
                                                        "application/pdf"))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["object"], doc["kind"], doc["pages"], doc["name"]) == ("document", "pdf", 2, "report.pdf")
    assert doc["content"] == document_text.frame(Document("report.pdf", "pdf", 2, doc["text"]))
    assert "Quarterly revenue rose." in doc["text"] and doc["chars"] == len(doc["text"])
    assert doc["tokens"] == n_tokens(server, doc["content"]) > 10


def test_a_text_file_is_read_and_counted(server):
    text = "# Notes\n\nThe launch code word is *marmalade*.\n"
    doc = post(server, name="notes.md", data=data_uri(text.encode(), "text/markdown")).json()
    assert (doc["kind"], doc["pages"], doc["text"]) == ("text", None, text)
    assert doc["content"] == "File: notes.md\n```\n" + text.rstrip() + "\n```"
    assert doc["tokens"] == n_tokens(server, doc["content"])


@pytest.mark.parametrize("name, raw, media_type, words", [
    ("scan.pdf", make_pdf([None]), "application/pdf", "scan.pdf has no text layer (1 page of pictures only, a scan?)"),
    ("fake.pdf", b"not a pdf at all", "application/pdf", "fake.pdf is not a PDF"),
    ("photo.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "image/png", "photo.png is not a text, markdown, code or PDF file"),
    ("latin.txt", "naïve café".encode("latin-1"), "text/plain", "latin.txt is not valid utf-8 text: byte 0xef"),
])
def test_what_cannot_be_read_is_a_400_that_says_why(server, name, raw, media_type, words):
    r = post(server, name=name, data=data_uri(raw, media_type))
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "data"


def test_a_charset_in_the_data_uri_is_honoured(server):
    raw = "naïve café".encode("latin-1")
    r = post(server, name="latin.txt", data="data:text/plain;charset=ISO-8859-1;base64," + base64.b64encode(raw).decode())
    assert r.status_code == 200 and r.json()["text"] == "naïve café", r.text


@pytest.mark.parametrize("body, param", [
    ({"data": data_uri(b"x")}, "name"),
    ({"name": "a.txt"}, "data"),
    ({"name": "a.txt", "data": "https://example.com/a.txt"}, "data"),
    ({"name": "a.txt", "data": "data:text/plain;base64,@@@"}, "data"),
    ({"name": "a.txt", "data": data_uri(b"x"), "model": 3}, "model"),
    ({"name": "a.txt", "data": data_uri(b"x"), "extra": 1}, "extra"),
])
def test_a_bad_body_is_a_400_naming_the_field(server, body, param):
    r = requests.post(server.url + "/api/documents", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_file_past_the_body_limit_is_a_413_with_the_limit(server):
    r = post(server, name="big.txt", data=data_uri(b"a" * MAX_BODY))
    assert r.status_code == 413, r.text
    assert f"{MAX_BODY:,} bytes" in r.json()["error"]["message"] and r.json()["error"]["max_body_bytes"] == MAX_BODY


# -- stored with the message ---------------------------------------------------------------------------

DOC = {"name": "notes.md", "kind": "text", "pages": None, "tokens": 12, "content": "File: notes.md\n```\nhi\n```"}


def test_documents_are_stored_with_a_user_message_and_checked(tmp_path):
    client = make_client(tmp_path / "c.db")
    conv = ok(client.post("/api/conversations", json={"messages": [
        {"role": "user", "content": "read this", "documents": [DOC, {**DOC, "name": "r.pdf", "kind": "pdf", "pages": 2}]},
        {"role": "assistant", "content": "ok"}]}), 201)
    again = ok(client.get(f"/api/conversations/{conv['id']}"))
    assert again["messages"][0]["documents"][1] == {**DOC, "name": "r.pdf", "kind": "pdf", "pages": 2}
    assert again["messages"][1]["documents"] is None
    for bad, param in [({"role": "assistant", "content": "x", "documents": [DOC]}, "messages[0].documents"),
                       ({"role": "user", "content": "x", "documents": [{**DOC, "kind": "zip"}]}, "messages[0].documents[0].kind"),
                       ({"role": "user", "content": "x", "documents": [{**DOC, "tokens": -1}]}, "messages[0].documents[0].tokens"),
                       ({"role": "user", "content": "x", "documents": [{**DOC, "path": "/etc"}]}, "messages[0].documents[0].path"),
                       ({"role": "user", "content": "x", "documents": [{**DOC, "name": ""}]}, "messages[0].documents[0].name")]:
        error(client.post(f"/api/conversations/{conv['id']}/messages", json={"messages": [bad], "from": 0}), 400, param)
    assert ok(client.get(f"/api/conversations/{conv['id']}"))["messages"] == again["messages"]   # nothing changed


# -- the page -----------------------------------------------------------------------------------------

PDF_TEXT, NOTE_TEXT = "The secret ingredient is cardamom.", "Remember to water the ferns on Tuesday."


@needs_browser
def test_the_page_attaches_a_pdf_and_a_text_file_sends_their_text_and_keeps_the_chips(server):
    with browser_page(server, "chat-documents") as page:
        sent = []
        page.on("request", lambda r: r.method == "POST" and r.url.endswith("/jobs")   # the reply's job
                and sent.append(json.dumps(json.loads(r.post_data)["request"])))
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#meter').textContent.includes('context')")
        greedy(page, 8)
        page.set_input_files("#file", files=[
            {"name": "recipe.pdf", "mimeType": "application/pdf", "buffer": make_pdf([PDF_TEXT])},
            {"name": "todo.txt", "mimeType": "text/plain", "buffer": NOTE_TEXT.encode()}])
        page.wait_for_function("document.querySelectorAll('#documents .doc-chip').length == 2")
        chips = page.locator("#documents .doc-chip .doc-name").all_inner_texts()
        assert chips[0].startswith("recipe.pdf · 1 page · ") and chips[1].startswith("todo.txt · "), chips
        page.fill("#input", "What is the secret ingredient?")
        page.keyboard.press("Enter")
        page.wait_for_selector(".turn.assistant .stats, .turn.assistant .note")
        page.wait_for_selector("#send:not([disabled])")
        assert page.locator(".msg.user .doc-chip").count() == 2 and not page.locator("#documents .doc-chip").count()
        body = json.loads(sent[-1])
        user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        assert user.startswith("File: recipe.pdf (PDF, 1 page)\n```\n" + PDF_TEXT)
        assert "File: todo.txt\n```\n" + NOTE_TEXT + "\n```" in user and user.endswith("\n\nWhat is the secret ingredient?")
        assert page.locator(".msg.user .text").inner_text() == "What is the secret ingredient?"   # chips, not the text
        page.reload()
        page.wait_for_selector(".msg.user .doc-chip")
        assert page.locator(".msg.user .doc-chip .doc-name").all_inner_texts() == chips
        assert not page.locator(".msg.error").count() and not page.console, page.console


@needs_browser
def test_the_page_refuses_a_file_too_large_for_the_context_with_the_numbers(server):
    with browser_page(server, "chat-documents-too-large") as page:
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#meter').textContent.includes('context')")
        greedy(page, 100)
        big = ("lorem ipsum dolor sit amet " * 800).encode()
        tokens = post(server, name="long.txt", data=data_uri(big)).json()["tokens"]
        assert tokens > N_CTX
        page.set_input_files("#file", files=[{"name": "long.txt", "mimeType": "text/plain", "buffer": big}])
        page.wait_for_selector(".msg.error")
        message = page.locator(".msg.error").inner_text()
        assert f"long.txt is too large for the context: {tokens:,} tokens" in message, message
        assert f"max tokens (100) the turn needs {tokens + 100:,} tokens, over the model's context of {N_CTX:,}" in message
        assert not page.locator("#documents .doc-chip").count()
        assert not page.console, page.console
