"""Pictures in requests, for every dialect: the one place an image's bytes are read, checked and
decoded (Pillow), before anything reaches the engine.

Each dialect's blueprint turns its own image block into an OpenAI `image_url` part (a `data:`
URI); `wire.py` reads the parts through `Images`, which puts IMAGE_MARKER in the message's text
where each picture was and keeps the decoded pictures, in order, for `Request.images`. The
engine (runners/vision.py) does the rest, or refuses a model without a projector.

An http(s) URL is fetched only when `--image-urls SECONDS` allows it: within that time, at most
`--max-body-bytes`, a 200 answer. Refused with a 400 naming the part: a URL when URLs are off,
one that fails, is too slow or too large, base64 that does not decode, bytes that are no image or an image of another format
than PNG, JPEG, WebP or GIF (its first frame), a truncated or corrupt file, a picture of more
than MAX_PIXELS pixels (checked from its header, before it is decoded), more than MAX_IMAGES
pictures or MAX_REQUEST_PIXELS pixels in one request.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import time
import warnings
from typing import Any

from appliance.engine.types import IMAGE_MARKER, ImageInput
from appliance.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 16 * 1024 * 1024      # per picture: 48 MiB of RGB to the engine at most
MAX_IMAGES = 16                    # per request
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS  # all of a request's pictures: what crosses to the engine is RGB


class Images:
    """The pictures of one request, in order, as `wire.py` meets them."""

    def __init__(self) -> None:
        self.found: list[ImageInput] = []

    def part(self, part: dict[str, Any], param: str) -> str:
        """An OpenAI `image_url` part -> the marker to put in the text; the picture kept."""
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise InvalidRequest(f"{param}.image_url must be an object with a 'url' string", param=param)
        self.add(data_uri(url, param), param)
        return IMAGE_MARKER

    def add(self, raw: bytes, param: str) -> None:
        if len(self.found) >= MAX_IMAGES:
            raise InvalidRequest(f"a request may carry at most {MAX_IMAGES} images", param=param)
        self.found.append(decode(raw, param))
        if sum(im.width * im.height for im in self.found) > MAX_REQUEST_PIXELS:
            raise InvalidRequest(f"a request's images may have {MAX_REQUEST_PIXELS:,} pixels in all", param=param)


def data_url(media_type: str, data: str) -> str:
    """A dialect's base64 picture as the data: URI an OpenAI part carries."""
    return f"data:{media_type};base64,{data}"


def image_url_part(url: str) -> dict[str, Any]:
    """OpenAI's image part, what every dialect's picture becomes."""
    return {"type": "image_url", "image_url": {"url": url}}


def data_uri(url: str, param: str) -> bytes:
    """The bytes of a `data:[type];base64,...` URI, or of an http(s) URL where they are allowed."""
    if url.startswith(("http://", "https://")):
        seconds, most = _url_policy()
        if seconds <= 0:
            raise InvalidRequest("image URLs are not fetched by this server (start it with --image-urls SECONDS "
                                 "to allow them); send the picture itself as a data: URI "
                                 "(data:image/png;base64,...)", param=param)
        return fetch(url, seconds, most, param)
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise InvalidRequest("an image must be a data: URI with base64 content (data:image/png;base64,...)",
                             param=param)
    return b64(data, param)


def _url_policy() -> tuple[float, int]:
    """(seconds a URL may take, bytes it may have) from the serving app's config; off outside one."""
    from flask import current_app, has_app_context

    if not has_app_context() or "appliance" not in current_app.extensions:
        return 0.0, 0
    server = current_app.extensions["appliance"].config.server
    return server.image_urls, server.max_body_bytes


def fetch(url: str, seconds: float, most: int, param: str) -> bytes:
    """An image URL's bytes: a 200 answer of at most `most` bytes, whole within `seconds`."""
    import requests

    deadline, body = time.monotonic() + seconds, bytearray()
    try:
        with requests.get(url, stream=True, timeout=seconds) as r:
            if r.status_code != 200:
                raise InvalidRequest(f"the image URL answered HTTP {r.status_code}", param=param)
            for chunk in r.iter_content(64 * 1024):
                body += chunk
                if len(body) > most:
                    raise InvalidRequest(f"the image at the URL is over {most:,} bytes", param=param)
                if time.monotonic() > deadline:
                    raise InvalidRequest(f"the image URL took longer than {seconds:g} s", param=param)
    except requests.Timeout:
        raise InvalidRequest(f"the image URL took longer than {seconds:g} s", param=param) from None
    except requests.RequestException as e:
        raise InvalidRequest(f"the image URL could not be fetched ({type(e).__name__})", param=param) from None
    return bytes(body)


def b64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the image's base64 does not decode", param=param) from None


def decode(raw: bytes, param: str) -> ImageInput:
    """Check and decode a picture to RGB; every way it can be wrong is a 400."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            if img.format not in FORMATS:
                raise InvalidRequest(f"images must be PNG, JPEG, WebP or GIF; this one is {img.format}",
                                     param=param)
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise InvalidRequest(f"the image is {w}x{h}: more than {MAX_PIXELS:,} pixels", param=param)
            img.seek(0)  # a GIF's (or animated WebP's) first frame
            rgb = img.convert("RGB").tobytes()
    except UnidentifiedImageError:
        raise InvalidRequest("the image is not a picture in a format this server reads (PNG, JPEG, WebP, GIF)",
                             param=param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):   # Pillow's limit is past ours
        raise InvalidRequest(f"the image has more than {MAX_PIXELS:,} pixels", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InvalidRequest(f"the image is truncated or corrupt ({type(e).__name__})", param=param) from None
    digest = hashlib.sha256(f"{w}x{h}:".encode() + rgb).hexdigest()
    return ImageInput(digest, w, h, rgb)
