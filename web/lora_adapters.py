"""llama-server's /lora-adapters: GET lists the model's adapters (id, path, scale), POST with
`[{"id": 0, "scale": 0.5}, ...]` sets the scales every request without its own `lora` runs under
(an adapter not listed at 0). The scales are the server's, kept per model on its `EngineClient`
(they outlive an engine restart); `?model=` names another model than the default."""
from __future__ import annotations

import json
import math
from typing import Any

from flask import Blueprint, jsonify, request

from appliance.engine.process import EngineClient
from appliance.errors import InvalidRequest

from . import serving, wire
from .lora import lora_of

bp = Blueprint("lora_adapters", __name__)


def _listed(engine: EngineClient) -> list[dict[str, Any]]:
    adapters = engine.info.adapters if engine.info is not None else ()
    scales = dict(engine.lora) if engine.lora is not None else {a.id: a.scale for a in adapters}
    return [{"id": a.id, "path": a.path, "scale": scales.get(a.id, 0.0)} for a in adapters]


@bp.get("/lora-adapters")
def list_adapters():
    with serving.model({"model": request.args.get("model")}) as (_, engine):
        return jsonify(_listed(engine))


@bp.post("/lora-adapters")
def set_adapters():
    try:
        body = wire.load_json(request.get_data(cache=False).decode("utf-8", "replace"), "the JSON body")
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e.msg}") from None
    scales = lora_of(body, "body")
    with serving.model({"model": request.args.get("model")}) as (_, engine):
        n = len(engine.info.adapters) if engine.info is not None else 0
        for i, (ident, scale) in enumerate(scales or ()):
            if not 0 <= ident < n:
                raise InvalidRequest(f"body[{i}].id: {ident} is not a LoRA adapter of this model "
                                     f"({n} loaded)", param=f"body[{i}].id")
            if not math.isfinite(scale):
                raise InvalidRequest(f"body[{i}].scale must be a finite number", param=f"body[{i}].scale")
        engine.lora = tuple(sorted(dict(scales or ()).items()))
        return jsonify({"success": True})
