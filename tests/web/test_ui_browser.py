"""The chat page in a real browser (headless Chromium driven by Playwright) against a real server
on the embedded model: conversations kept by the server across a reload, markdown and code with
a copy button, a model's HTML inert, stop / regenerate / edit / continue, the reasoning block,
the context meter, a phone-width screen and the API-key prompt."""
from __future__ import annotations

import json

import pytest
import requests

from ..engine.gguf_fixtures import write_tiny_llama
from .browser import browser_page, needs_browser
from .conftest import running_server
from .test_reasoning_e2e import THINKING_TEMPLATE

pytestmark = needs_browser


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ui"), "--n-ctx", "2048", "--n-slots", "2") as srv:
        yield srv


def conversations(server, headers=None) -> list[dict]:
    return requests.get(server.url + "/api/conversations", headers=headers, timeout=10).json()["data"]


def settle(page) -> None:
    """Wait until no reply is streaming (Send enabled again)."""
    page.wait_for_selector("#send:not([disabled])")


def ask(page, text: str) -> None:
    n = page.locator(".stats, .turn.assistant .note").count()
    page.fill("#input", text)
    page.keyboard.press("Enter")
    page.wait_for_function(f"document.querySelectorAll('.stats, .turn.assistant .note').length > {n}")
    settle(page)


def greedy(page, max_tokens: int = 24) -> None:
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))
    page.locator("#max_tokens").dispatch_event("change")
    page.locator("#temperature").dispatch_event("change")
    page.click("#settings summary")


def test_three_turns_survive_a_reload_and_conversations_are_listed_renamed_and_deleted(server):
    with browser_page(server, "chat-three-turns") as page:
        page.goto(server.url + "/")
        greedy(page)
        for q in ("What is the capital of France?", "And of Italy?", "And of Spain?"):
            ask(page, q)
        assert page.locator(".turn").count() == 6 and not page.locator(".msg.error").count()
        stats = [json.loads(s.get_attribute("data-timings")) for s in page.locator(".stats").all()]
        assert all("TTFT" in s for s in page.locator(".stats").all_inner_texts())
        assert stats[2]["prompt_n"] + stats[2].get("cache_n", 0) > stats[0]["depth"]  # the history was sent
        page.reload()
        page.wait_for_selector(".turn.assistant .stats")
        assert page.locator(".msg.user").all_inner_texts() == ["What is the capital of France?", "And of Italy?",
                                                               "And of Spain?"]
        assert page.locator(".stats").count() == 3    # the timings were stored with the replies
        assert page.locator("#settings-summary").inner_text().startswith("temperature 0 ")
        # a second conversation; both listed, newest first
        page.click("#new")
        ask(page, "Name a colour.")
        page.wait_for_function("document.querySelectorAll('#convs .conv').length == 2")
        assert page.locator("#convs .conv .ctitle").first.inner_text() == "Name a colour."
        # rename, search, delete
        page.click("#rename")
        page.fill("#title-edit", "Colours")
        page.keyboard.press("Enter")
        page.wait_for_function("document.querySelector('#convs .conv .ctitle')?.textContent == 'Colours'")
        page.fill("#search", "Italy")
        page.wait_for_function("document.querySelectorAll('#convs .conv').length == 1")
        assert page.locator("#convs .conv .ctitle").inner_text().startswith("What is the capital")
        page.fill("#search", "")
        page.wait_for_function("document.querySelectorAll('#convs .conv').length == 2")
        page.once("dialog", lambda d: d.accept())
        page.click("#delete")
        page.wait_for_function("document.querySelectorAll('#convs .conv').length == 1")
        assert [c["title"] for c in conversations(server)] == ["What is the capital of France?"]
        assert not page.console, page.console


MARKDOWN = ("Here is a table and some code.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            "```python\ndef add(x, y):\n    return x + y\n```\n\n"
            "<script>window.__pwned = 1</script> and <img src=x onerror=\"window.__pwned = 2\"> inline.")


def test_markdown_renders_code_copies_and_html_from_the_model_is_inert(server):
    made = requests.post(server.url + "/api/conversations", json={"title": "markdown", "messages": [
        {"role": "user", "content": "show me"}, {"role": "assistant", "content": MARKDOWN}]}, timeout=10).json()
    with browser_page(server, "chat-markdown") as page:
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        page.goto(server.url + "/#" + made["id"])
        page.wait_for_selector(".msg.assistant table")
        assert page.locator(".msg.assistant td").all_inner_texts() == ["1", "2"]
        code = page.locator(".msg.assistant pre code")
        assert "hljs" in code.get_attribute("class") and code.locator("span").count() > 0   # highlighted
        page.click(".msg.assistant pre .copy")
        page.wait_for_function("document.querySelector('.msg.assistant pre .copy')?.textContent == 'Copied'")
        assert page.evaluate("navigator.clipboard.readText()") == "def add(x, y):\n    return x + y"
        # the model's HTML is shown as text and nothing in it ran
        text = page.locator(".msg.assistant .content").inner_text()
        assert "<script>window.__pwned = 1</script>" in text and 'onerror="window.__pwned = 2"' in text
        assert page.evaluate("window.__pwned") is None
        assert page.locator(".msg.assistant script, .msg.assistant img").count() == 0
        assert not page.console, page.console


def test_tool_calls_and_results_have_their_own_blocks(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    made = requests.post(server.url + "/api/conversations", json={"title": "tools", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is **21 °C** in Paris."}]}, timeout=10).json()
    with browser_page(server, "chat-tools") as page:
        page.goto(server.url + "/#" + made["id"])
        page.wait_for_selector(".toolcall")
        assert page.locator(".toolcall .label").inner_text() == "tool call · get_weather · call_1"
        assert '"city": "Paris"' in page.locator(".toolcall pre").inner_text()
        assert page.locator(".msg.tool .label").inner_text() == "tool result · call_1"
        assert page.locator(".msg.tool pre").inner_text() == '{"temp_c": 21}'
        assert page.locator(".msg.assistant strong").last.inner_text() == "21 °C"
        assert not page.console, page.console


def test_stop_regenerate_continue_and_edit(server):
    with browser_page(server, "chat-stop-regenerate-edit") as page:
        page.goto(server.url + "/")
        page.click("#settings summary")
        page.fill("#max_tokens", "600")
        page.locator("#max_tokens").dispatch_event("change")
        page.fill("#input", "Write a long story about a lighthouse keeper.")
        page.keyboard.press("Enter")
        page.wait_for_function("(document.querySelector('.msg.assistant .content')?.textContent || '').length > 20")
        page.keyboard.press("Escape")                      # Esc stops
        settle(page)
        assert page.locator(".turn.assistant .note").inner_text() == "stopped"
        stopped = page.locator(".msg.assistant .content").inner_text()
        conv_id = page.evaluate("location.hash.slice(1)")
        stored = requests.get(f"{server.url}/api/conversations/{conv_id}", timeout=10).json()["messages"]
        assert stored[1]["finish_reason"] == "cancelled" and stored[1]["content"].strip()
        # continue the stopped reply: it grows from where it was
        page.fill("#max_tokens", "8")
        page.locator("#max_tokens").dispatch_event("change")
        page.click(".turn.assistant .continue")
        page.wait_for_selector(".turn.assistant .stats")
        settle(page)
        grown = page.locator(".msg.assistant .content").inner_text()
        assert len(grown) > len(stopped) and grown.startswith(stopped.strip()[:20])
        # regenerate replaces the reply
        page.click(".turn.assistant .regenerate")
        page.wait_for_selector(".turn.assistant .stats")
        settle(page)
        assert page.locator(".turn.assistant").count() == 1
        # edit the question and send again: the old reply is gone, the new question answered
        page.click(".turn.user .edit")
        page.fill(".editbox", "Name three fruits.")
        page.click(".turn.user .save")
        # the edit is saved before the page re-renders, so the old reply's stats stay a moment:
        # wait for the new question's own reply
        page.wait_for_function("[...document.querySelectorAll('.msg.user')].map(e => e.textContent.trim()).join('|')"
                               " === 'Name three fruits.' && !!document.querySelector('.turn.assistant .stats')"
                               " && !document.getElementById('send').disabled")
        assert page.locator(".msg.user").all_inner_texts() == ["Name three fruits."]
        stored = requests.get(f"{server.url}/api/conversations/{conv_id}", timeout=10).json()["messages"]
        assert [m["role"] for m in stored] == ["user", "assistant"] and stored[0]["content"] == "Name three fruits."
        assert not page.console, page.console


def test_context_meter_warns_and_phone_width_hides_the_list(server):
    with browser_page(server, "chat-meter-phone", viewport={"width": 390, "height": 800}) as page:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('meter').textContent.includes('/ 2,048')")
        assert page.locator("#thinking").is_disabled()          # SmolLM2's template has no switch
        assert not page.locator("#sidebar").is_visible()
        page.click("#menu")
        assert page.locator("#sidebar").is_visible()
        page.mouse.click(380, 400)                           # a tap beside the list closes it
        assert not page.locator("#sidebar").is_visible()
        page.click("#settings summary")
        page.fill("#max_tokens", "2040")
        page.locator("#max_tokens").dispatch_event("change")
        page.fill("#input", "A question that will not fit")
        page.focus("#input")
        page.keyboard.press("Shift+Enter")                     # a new line, not a send
        page.keyboard.type("with that many tokens to generate.")
        assert page.input_value("#input") == "A question that will not fit\nwith that many tokens to generate."
        assert page.locator(".turn").count() == 0
        page.wait_for_selector("#meter.over")
        assert "may be refused" in page.locator("#meter").get_attribute("title")
        assert not page.console, page.console


def test_a_long_prompt_shows_its_reading_progress_until_the_reply_begins(server):
    """The page asks for llama-server's prompt_progress: while a long prompt is read, a bar over
    the reply says how many of its tokens are done; it goes when the reply begins."""
    with browser_page(server, "chat-progress") as page:
        page.goto(server.url + "/")
        greedy(page, max_tokens=4)
        page.evaluate("""() => { window.seenBars = [];
            new MutationObserver(() => document.querySelectorAll('.prefill span').forEach(
                (s) => window.seenBars.push(s.textContent))).observe(document.body, {subtree: true, childList: true,
                                                                                    characterData: true}); }""")
        ask(page, "Summarise this list: " + "apples, pears, plums, cherries, " * 150)
        seen = page.evaluate("window.seenBars")
        assert seen and all(t.startswith("reading the prompt · ") for t in seen), seen
        assert not page.locator(".prefill").count()          # gone once the reply came
        assert not page.console, page.console


@pytest.mark.parametrize("path", ["/", "/host", "/bench"])
def test_every_page_loads_only_from_the_appliance(server, path):
    """Offline: no CDN, no font or script from anywhere else; and no request fails."""
    with browser_page(server, "offline" + path.replace("/", "-")) as page:
        seen, failed = [], []
        page.on("request", lambda r: seen.append(r.url))
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.goto(server.url + path, wait_until="networkidle")
        assert seen and all(u.startswith(server.url + "/") or u.startswith("data:") for u in seen), seen
        assert not failed and not page.console, (failed, page.console)


def test_light_and_dark_follow_the_system(server):
    with browser_page(server, "chat-dark", color_scheme="dark") as page:
        page.goto(server.url + "/")
        dark = page.evaluate("getComputedStyle(document.body).backgroundColor")
        page.emulate_media(color_scheme="light")
        light = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert dark == "rgb(17, 19, 23)" and light == "rgb(247, 247, 248)"


def test_reasoning_is_folded_in_its_own_block(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny-thinker.gguf", chat_template=THINKING_TEMPLATE)
    with running_server(tmp_path, "--model", str(model), "--n-ctx", "256", "--n-slots", "1") as srv, \
            browser_page(srv, "chat-reasoning") as page:
        page.goto(srv.url + "/")
        greedy(page, max_tokens=12)
        page.wait_for_function("document.getElementById('meter').textContent.includes('/ 256')")  # /health read
        assert page.locator("#thinking").is_enabled()          # its template has enable_thinking
        ask(page, "Why is the sky blue?")
        block = page.locator(".msg.assistant details.reasoning")
        assert block.count() == 1 and block.get_attribute("open") is None       # folded
        assert block.locator("summary").inner_text().startswith("Reasoning · ")
        block.locator("summary").click()
        assert block.locator(".rtext").inner_text().strip()
        assert not page.console, page.console


def test_the_page_asks_for_the_api_key_once(tmp_path):
    key = "page-key-123"
    with running_server(tmp_path, "--n-ctx", "256", "--n-slots", "1", "--api-key", key,
                        health_headers={"Authorization": f"Bearer {key}"}) as srv, \
            browser_page(srv, "chat-api-key") as page:
        page.goto(srv.url + "/")
        page.wait_for_selector("#keydialog[open]")
        page.fill("#apikey", "wrong")
        page.click("#keysave")
        page.wait_for_selector("#keyerror:not([hidden])")     # refused: asked again
        page.fill("#apikey", key)
        page.click("#keysave")
        page.wait_for_function("!document.getElementById('keydialog').open")
        greedy(page, max_tokens=8)
        ask(page, "Hello")
        assert page.locator(".stats").count() == 1
        page.reload()                                          # kept: not asked again
        page.wait_for_selector("#convs .conv")
        assert not page.locator("#keydialog[open]").count()
        assert [m for m in page.console if "401" not in m] == []


def test_a_picture_for_a_model_that_takes_none_is_said_and_not_sent(server):
    from ..engine.mmproj_fixture import picture

    with browser_page(server, "chat-picture-text-model") as page:
        page.goto(server.url + "/")
        greedy(page, max_tokens=4)
        page.set_input_files("#file", files=[{"name": "a.png", "mimeType": "image/png", "buffer": picture(seed=1)}])
        page.wait_for_selector("#vision-note:not([hidden])")
        assert "does not take images" in page.inner_text("#vision-note")
        ask(page, "What is this?")               # the text goes; the picture stays on the page only
        assert not page.locator(".msg.error").count() and page.locator(".msg.user img.thumb").count() == 1
        assert not page.console, page.console
