"""Images through every API, end to end: `appliance serve --mmproj` with a tiny random projector
beside a tiny text model of its width (tests/engine/mmproj_fixture.py), one server for the
module. Each dialect's picture reaches the engine as the projector's 16 rows (its prompt counts
them) and shapes the reply; a follow-up turn with the same picture reuses its KV from the
prompt cache and one with another picture does not; each bad picture is a 400 in the dialect's
shape and the server goes on serving."""
from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.engine.mmproj_fixture import N_IMAGE_TOKENS, picture, write_vision_pair

from .browser import browser_page, needs_browser
from .conftest import SHARED, running_server
from .test_ui_browser import greedy

MODEL = "tiny-vision"
QUESTION = "Describe the picture."
# text after the picture, long enough that the cache's whole blocks (64 tokens) cover the picture
LONG = " ".join(f"Note {i}: the picture may show a cat, a dog or a tree." for i in range(12))


def data_uri(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    model, mmproj = write_vision_pair(d)
    with running_server(d, "--model", str(model), "--mmproj", str(mmproj), "--n-ctx", "512",
                        "--n-slots", "2", "--seed", "7", "--image-urls", "1", "--max-body-bytes", str(1 << 20)) as s:
        yield s


class _Pictures(http.server.BaseHTTPRequestHandler):
    """A picture host for the URL tests: /cat.png, /big.png (over the 1 MiB limit), /slow.png
    (answers after 2 s, past the 1 s limit), anything else 404."""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(2)
        body = {"/cat.png": picture(seed=1), "/slow.png": picture(seed=1), "/big.png": b"\0" * (2 << 20)}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def pictures():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def chat(server, content, *, extra=None, messages=None, **kw):
    body = {"messages": messages or [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def image_message(raw: bytes, text: str = QUESTION) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_uri(raw)}}, {"type": "text", "text": text}]


def test_health_models_and_ollama_show_say_the_model_sees_images(server):
    assert server.health()["settings"]["mmproj"]["vision"] is True
    card = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["meta"]["vision"] is True
    shown = requests.post(server.url + "/api/show", json={"model": MODEL}, timeout=10).json()
    assert "vision" in shown["capabilities"]
    assert requests.get(server.url + "/props", timeout=10).json()["modalities"]["vision"] is True   # llama-server's


def test_openai_image_counts_its_rows_and_shapes_the_reply(server):
    text_only = chat(server, QUESTION).json()["usage"]["prompt_tokens"]
    a = chat(server, image_message(picture(seed=1)), logprobs=True)
    assert a.status_code == 200, a.text
    assert a.json()["usage"]["prompt_tokens"] == text_only + N_IMAGE_TOKENS
    again = chat(server, image_message(picture(seed=1)), logprobs=True).json()
    other = chat(server, image_message(picture(seed=2)), logprobs=True).json()
    first = lambda r: r["choices"][0]["logprobs"]["content"][0]["logprob"]  # noqa: E731
    assert again["choices"][0]["message"] == a.json()["choices"][0]["message"]
    assert first(again) == first(a.json())
    assert first(other) != first(a.json())


def test_two_images_in_one_message(server):
    r = chat(server, [*image_message(picture(seed=1), "and"), *image_message(picture(seed=2))])
    one = chat(server, image_message(picture(seed=1), "and")).json()["usage"]["prompt_tokens"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > one + N_IMAGE_TOKENS


def test_a_follow_up_turn_reuses_the_picture_from_the_cache(server):
    turn1 = [{"role": "user", "content": image_message(picture(seed=3), LONG)}]
    r1 = chat(server, None, messages=turn1).json()
    reply = r1["choices"][0]["message"]["content"]

    def follow_up(seed: int) -> dict:
        msgs = [{"role": "user", "content": image_message(picture(seed=seed), LONG)},
                {"role": "assistant", "content": reply}, {"role": "user", "content": "And the colours?"}]
        return chat(server, None, messages=msgs).json()

    same = follow_up(3)
    cached = same["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the picture's rows start a few tokens in: whole 64-token blocks past them are reused
    assert cached >= 64, same["usage"]
    assert same["timings"]["cache_n"] == cached
    other = follow_up(4)     # another picture at the same place: nothing from the picture on
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 8, other["usage"]


def test_streams_with_and_without_pictures_at_once_give_what_each_gives_alone(server):
    asks = [image_message(picture(seed=1)), image_message(picture(seed=2)), QUESTION]
    alone = [chat(server, c, max_tokens=16).json()["choices"][0]["message"]["content"] for c in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda c: chat(server, c, max_tokens=16, stream=False).json(), asks))
    assert [r["choices"][0]["message"]["content"] for r in together] == alone


def test_over_the_context_counting_the_image_is_a_400_before_any_byte(server):
    text_only = chat(server, QUESTION).json()["usage"]["prompt_tokens"]
    room = 512 - text_only   # max_tokens that fits the text alone, not the picture's 16 rows too
    with requests.post(server.url + "/v1/chat/completions", stream=True, timeout=60, json={
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": room, "stream": True}) as fits:
        assert fits.status_code == 200     # (closed at once: the request is cancelled)
    r = chat(server, image_message(picture(seed=1)), max_tokens=room, stream=True)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["n_prompt_tokens"] == text_only + N_IMAGE_TOKENS and err["n_ctx"] == 512


def test_anthropic_image_block(server):
    body = {"model": "x", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(picture(seed=1))}},
        {"type": "text", "text": QUESTION}]}]}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plain = {**body, "messages": [{"role": "user", "content": QUESTION}]}
    n_plain = requests.post(server.url + "/v1/messages", json=plain, timeout=60).json()["usage"]["input_tokens"]
    assert r.json()["usage"]["input_tokens"] == n_plain + N_IMAGE_TOKENS
    openai = chat(server, image_message(picture(seed=1))).json()["choices"][0]["message"]["content"]
    assert r.json()["content"][0]["text"] == openai
    counted = requests.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60)
    assert counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]


def test_anthropic_image_in_a_tool_result(server):
    """A screenshot tool's picture reaches the model as a user turn's does, and is counted."""
    def turn(result):
        return {"model": "x", "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": result}]}]}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(picture(seed=1))}}
    with_picture = turn([{"type": "text", "text": "the screen:"}, image])
    r = requests.post(server.url + "/v1/messages", json=with_picture, timeout=60)
    assert r.status_code == 200, r.text
    text = requests.post(server.url + "/v1/messages", json=turn("the screen:"), timeout=60).json()
    assert r.json()["usage"]["input_tokens"] == text["usage"]["input_tokens"] + N_IMAGE_TOKENS
    counted = requests.post(server.url + "/v1/messages/count_tokens", json=with_picture, timeout=60)
    assert counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]


def test_responses_input_image(server):
    body = {"model": "x", "max_output_tokens": 8, "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_uri(picture(seed=1))},
        {"type": "input_text", "text": QUESTION}]}]}
    r = requests.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    n_plain = chat(server, QUESTION).json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["input_tokens"] == n_plain + N_IMAGE_TOKENS
    openai = chat(server, image_message(picture(seed=1))).json()["choices"][0]["message"]["content"]
    assert r.json()["output"][-1]["content"][0]["text"] == openai


def test_ollama_chat_and_generate_images(server):
    opts = {"temperature": 0, "num_predict": 8}
    msg = {"role": "user", "content": QUESTION, "images": [b64(picture(seed=1))]}
    r = requests.post(server.url + "/api/chat", json={"model": MODEL, "stream": False, "messages": [msg],
                                                      "options": opts}, timeout=60)
    assert r.status_code == 200, r.text
    plain = requests.post(server.url + "/api/chat", json={"model": MODEL, "stream": False, "options": opts,
                                                          "messages": [{"role": "user", "content": QUESTION}]},
                          timeout=60).json()
    assert r.json()["prompt_eval_count"] == plain["prompt_eval_count"] + N_IMAGE_TOKENS
    g = requests.post(server.url + "/api/generate", json={"model": MODEL, "stream": False, "prompt": QUESTION,
                                                          "images": [b64(picture(seed=1))], "options": opts},
                      timeout=60)
    assert g.status_code == 200, g.text
    assert g.json()["prompt_eval_count"] == r.json()["prompt_eval_count"]
    assert g.json()["response"] == r.json()["message"]["content"]


def test_llama_server_completion_multimodal_prompt(server):
    prompt = {"prompt_string": "<__media__>" + QUESTION, "multimodal_data": [b64(picture(seed=1))]}
    r = requests.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0},
                      timeout=60)
    assert r.status_code == 200, r.text
    plain = requests.post(server.url + "/completion", json={"prompt": QUESTION, "n_predict": 8,
                                                            "temperature": 0}, timeout=60).json()
    assert r.json()["tokens_evaluated"] == plain["tokens_evaluated"] + N_IMAGE_TOKENS
    other = {**prompt, "multimodal_data": [b64(picture(seed=1))] * 2}   # two pictures, one marker
    bad = requests.post(server.url + "/completion", json={"prompt": other, "n_predict": 8}, timeout=60)
    assert bad.status_code == 400 and "image markers" in bad.text


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header says width x height (its data does not follow): the pixel limit
    must refuse it from the header, before decoding."""
    raw = bytearray(picture("red", size=(4, 4)))
    ihdr = struct.pack(">II", width, height) + bytes(raw[24:29])
    raw[16:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(raw)


BAD = {
    "corrupt": (data_uri(b"\x00\x01not an image at all" * 20), "not a picture"),
    "truncated": (data_uri(picture(seed=5)[:300]), "truncated or corrupt"),
    "unsupported format": (data_uri(picture(seed=5, fmt="BMP"), "image/bmp"), "PNG, JPEG, WebP or GIF"),
    "100 megapixels": (data_uri(png_claiming(10_000, 10_000)), "pixels"),
    "not base64": ("data:image/png;base64,@@@@", "base64"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_picture_is_a_400_and_the_server_goes_on(server, case):
    url, says = BAD[case]
    r = chat(server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}])
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("messages[0].content[0]")
    assert chat(server, image_message(picture(seed=1))).status_code == 200


def test_too_many_images_is_a_400(server):
    r = chat(server, [{"type": "image_url", "image_url": {"url": data_uri(picture("red", size=(8, 8)))}}] * 17)
    assert r.status_code == 400 and "at most 16 images" in r.json()["error"]["message"]


def test_bad_pictures_in_other_dialects_come_in_their_shape(server):
    body = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(b"junk" * 50)}}]}]}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    o = requests.post(server.url + "/api/chat", json={"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [b64(b"junk" * 50)]}]}, timeout=60)
    assert o.status_code == 400 and "error" in o.json() and isinstance(o.json()["error"], str)
    resp = requests.post(server.url + "/v1/responses", json={"model": "x", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_uri(b"junk" * 50)}]}]}, timeout=60)
    assert resp.status_code == 400 and "not a picture" in resp.json()["error"]["message"]
    ls = requests.post(server.url + "/completion", json={"prompt": {"prompt_string": "<__media__>hi",
                                                                   "multimodal_data": [b64(b"junk" * 50)]}}, timeout=60)
    assert ls.status_code == 400 and "not a picture" in ls.json()["error"]["message"]
    assert chat(server, image_message(picture(seed=1))).status_code == 200        # and it goes on serving


def test_image_urls_are_fetched_within_their_limits_where_allowed(server, pictures):
    def with_url(path: str):
        return chat(server, [{"type": "image_url", "image_url": {"url": pictures + path}},
                             {"type": "text", "text": QUESTION}])

    fetched = with_url("/cat.png")
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"] == chat(server, image_message(picture(seed=1))).json()["choices"][0]["message"]
    for path, says in (("/big.png", "over 1,048,576 bytes"), ("/slow.png", "longer than 1 s"), ("/nope.png", "HTTP 404")):
        r = with_url(path)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (path, r.text)


def test_a_text_only_model_refuses_images_and_urls_are_off_by_default(shared_server):
    text = shared_server(*SHARED)
    r = chat(text, image_message(picture(seed=1)))
    assert r.status_code == 400
    assert "does not take images" in r.json()["error"]["message"]
    url = chat(text, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert url.status_code == 400 and "not fetched" in url.json()["error"]["message"]
    assert chat(text, QUESTION).status_code == 200


PASTE_AND_DROP = """([b64]) => {
  const file = (name) => new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, { type: "image/png" });
  const pasted = new DataTransfer(); pasted.items.add(file("pasted.png"));
  document.getElementById("input").dispatchEvent(new ClipboardEvent("paste", { clipboardData: pasted, bubbles: true }));
  const dropped = new DataTransfer(); dropped.items.add(file("dropped.png"));
  document.getElementById("composer").dispatchEvent(new DragEvent("drop", { dataTransfer: dropped, bubbles: true }));
}"""


@needs_browser
def test_the_chat_page_attaches_pastes_and_drops_pictures_and_keeps_them(server):
    text_only = chat(server, QUESTION).json()["usage"]["prompt_tokens"]
    with browser_page(server, "chat-images") as page:
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#vision-note').hidden")
        greedy(page, max_tokens=8)
        page.set_input_files("#file", files=[{"name": "a.png", "mimeType": "image/png", "buffer": picture(seed=1)}])
        page.wait_for_selector("#attachments img.thumb")
        page.fill("#input", QUESTION)
        page.keyboard.press("Enter")
        page.wait_for_selector(".turn.assistant .stats")
        page.wait_for_selector("#send:not([disabled])")
        assert page.locator(".msg.user img.thumb").count() == 1 and not page.locator("#attachments img").count()
        timings = json.loads(page.locator(".stats").first.get_attribute("data-timings"))
        assert timings["prompt_n"] + timings.get("cache_n", 0) == text_only + N_IMAGE_TOKENS   # the picture was sent
        page.reload()
        page.wait_for_selector(".msg.user img.thumb")      # stored with the conversation
        page.evaluate(PASTE_AND_DROP, [b64(picture(seed=2))])
        page.wait_for_function("document.querySelectorAll('#attachments img.thumb').length == 2")
        page.click("#attachments .unattach")
        assert page.locator("#attachments img.thumb").count() == 1
        big = picture(seed=3, size=(2600, 1200))       # ~9 MB of PNG noise, past 2,048 px wide
        page.set_input_files("#file", files=[{"name": "big.png", "mimeType": "image/png", "buffer": big}])
        page.wait_for_function("document.querySelectorAll('#attachments img.thumb').length == 2")
        src = page.locator("#attachments img.thumb").last.get_attribute("src")
        assert src.startswith("data:image/jpeg;base64,") and len(src) < len(big) / 3   # scaled, a JPEG
        from PIL import Image
        assert Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).size == (2048, 945)
        assert not page.console, page.console
