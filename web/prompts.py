"""A completions request's prompt: one, or several in one request (a batch).

OpenAI's /v1/completions takes a string, token ids, or a list of either (a prompt each);
llama-server's /completion takes those, token ids and strings mixed, and its multimodal object
{"prompt_string", "multimodal_data"}. Which list is one prompt and which several is
llama-server's rule (tokenize_input_prompts): a list with a number among its elements is one
prompt, its token ids (maybe mixed with strings); any other list holds a prompt per element. A
batch is at most MAX_PROMPTS prompts: each becomes an engine request of its own (web/batch.py),
waiting for a slot in the queue as any request does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.engine.types import ImageInput
from appliance.errors import InvalidRequest

from .images import Images, b64

MAX_PROMPTS = 32


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completions request: its text or its token ids, and its pictures."""

    text: str | None
    ids: tuple[int, ...] | None
    images: tuple[ImageInput, ...] = ()


def is_ids(v: Any) -> bool:
    """Whether `v` is a list of token ids."""
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def split(value: Any) -> list[Any]:
    """The prompts `value` holds, each as the client wrote it ([value] for one prompt); a 400 for
    an empty list or more than MAX_PROMPTS."""
    if not isinstance(value, list) or any(_is_int(v) for v in value):
        return [value]
    if not value:
        raise InvalidRequest("'prompt' must not be an empty list", param="prompt")
    if len(value) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' holds {len(value)} prompts; one request takes at most {MAX_PROMPTS}",
                             param="prompt")
    return value


def read_all(value: Any) -> tuple[Prompt, ...]:
    """An OpenAI completions body's prompts (one, or a batch), each checked, its pictures read;
    a 400 naming the prompt (`prompt[i]` in a batch) otherwise."""
    if value is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    parts = split(value)
    images = Images()          # the pictures' limits hold for the whole request
    out = []
    for i, part in enumerate(parts):
        seen = len(images.found)
        text, ids = _read(part, "prompt" if len(parts) == 1 else f"prompt[{i}]", images)
        out.append(Prompt(text, ids, tuple(images.found[seen:])))
    return tuple(out)


def _read(value: Any, param: str, images: Images) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, dict):
        value = _multimodal(value, param, images)
    if isinstance(value, str):
        return value, None
    if value and is_ids(value):
        return None, tuple(value)
    raise InvalidRequest(f"'{param}' must be a string or a non-empty list of token ids", param=param)


def _multimodal(prompt: dict, param: str, images: Images) -> str:
    """llama-server's multimodal prompt: {"prompt_string": text with an IMAGE_MARKER per
    picture, "multimodal_data": [base64, ...]}; its text, the pictures kept in `images`."""
    text, data = prompt.get("prompt_string"), prompt.get("multimodal_data", [])
    if not isinstance(text, str) or not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise InvalidRequest("a multimodal prompt is {\"prompt_string\": text, \"multimodal_data\": "
                             "[base64 images]}", param=param)
    for k, d in enumerate(data):
        images.add(b64(d, f"{param}.multimodal_data[{k}]"), f"{param}.multimodal_data[{k}]")
    return text
