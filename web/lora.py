"""LoRA adapters on the wire, as llama-server reads them: a request's `lora` on llama-server's and
OpenAI's routes, `[{"id": 0, "scale": 0.5}, ...]` (an adapter not listed at 0), and the scales
POST /lora-adapters set (lora_adapters.py) for the requests that give none. The engine checks a
request's ids against the adapters it loaded (engine/lora.py: a 400 naming the field)."""
from __future__ import annotations

import dataclasses
from typing import Any

from appliance.engine.process import EngineClient
from appliance.engine.types import Request
from appliance.errors import InvalidRequest

LoraScales = tuple[tuple[int, float], ...]


def lora_of(value: Any, name: str = "lora") -> LoraScales | None:
    """A list of {"id", "scale"} as (id, scale) pairs (None: not given); a 400 naming the field
    that is not of that shape."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest(f"'{name}' must be an array of objects with 'id' and 'scale' fields", param=name)
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise InvalidRequest(f"{name}[{i}] must be an object with 'id' and 'scale'", param=f"{name}[{i}]")
        ident, scale = entry.get("id"), entry.get("scale", 0.0)
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise InvalidRequest(f"{name}[{i}].id must be an adapter's id (an integer)", param=f"{name}[{i}].id")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise InvalidRequest(f"{name}[{i}].scale must be a number", param=f"{name}[{i}].scale")
        out.append((ident, float(scale)))
    return tuple(out)


def with_global(req: Request, engine: EngineClient) -> Request:
    """The request under the scales POST /lora-adapters set, when it gives none of its own."""
    return req if req.lora is not None or engine.lora is None else dataclasses.replace(req, lora=engine.lora)
