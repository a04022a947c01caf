"""web/images.py alone: every format it takes decodes to the same RGB pixels (GIF: its first
frame), the content hash names the pixels and not the file, and each bad picture is refused with
the reason, naming the part. No server, no model."""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from appliance.errors import InvalidRequest
from web import images

RED, BLUE = (255, 0, 0), (0, 0, 255)


def encoded(fmt: str, colour=RED, size=(8, 6), **save) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt, **save)
    return out.getvalue()


@pytest.mark.parametrize("fmt,save", [("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("JPEG", {"quality": 100})])
def test_each_format_decodes_to_rgb(fmt, save):
    im = images.decode(encoded(fmt, **save), "p")
    assert (im.width, im.height) == (8, 6) and len(im.rgb) == 8 * 6 * 3
    assert all(abs(a - b) <= 2 for a, b in zip(im.rgb[:3], RED))      # JPEG: within rounding


def test_the_same_pixels_in_another_file_are_the_same_picture():
    assert images.decode(encoded("PNG"), "p").digest == images.decode(encoded("WEBP", lossless=True), "p").digest
    assert images.decode(encoded("PNG"), "p").digest != images.decode(encoded("PNG", BLUE), "p").digest


def test_an_animated_gif_is_its_first_frame():
    out = io.BytesIO()
    frames = [Image.new("RGB", (4, 4), c) for c in (BLUE, RED)]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    assert images.decode(out.getvalue(), "p").rgb[:3] == bytes(BLUE)


@pytest.mark.parametrize("raw,says", [
    (encoded("BMP"), "PNG, JPEG, WebP or GIF"), (encoded("TIFF"), "PNG, JPEG, WebP or GIF"),
    (b"not a picture" * 10, "not a picture"), (encoded("PNG", size=(64, 64))[:60], "truncated or corrupt"),
])
def test_bad_pictures_are_refused_naming_the_part(raw, says):
    with pytest.raises(InvalidRequest, match=says) as e:
        images.decode(raw, "messages[0].content[1]")
    assert e.value.param == "messages[0].content[1]"


def test_data_uris_and_urls():
    raw = encoded("PNG")
    assert images.data_uri("data:image/png;base64," + base64.b64encode(raw).decode(), "p") == raw
    for url, says in (("data:image/png,abc", "base64"), ("data:image/png;base64,***", "does not decode"),
                      ("ftp://x/y.png", "data: URI"), ("http://x/y.png", "not fetched")):
        with pytest.raises(InvalidRequest, match=says):
            images.data_uri(url, "p")


def test_a_requests_pictures_have_a_pixel_budget(monkeypatch):
    monkeypatch.setattr(images, "MAX_REQUEST_PIXELS", 100)
    found = images.Images()
    found.add(encoded("PNG", size=(8, 6)), "a")                      # 48 pixels
    found.add(encoded("PNG", size=(8, 6)), "b")                      # 96
    with pytest.raises(InvalidRequest, match="100 pixels in all"):
        found.add(encoded("PNG", size=(2, 3)), "c")                  # 102
