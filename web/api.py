"""The appliance's own routes: /v1/models, /health, /metrics, /openapi.json, and loading and
unloading a model of the pool (/api/models/load and /unload). The API dialects are blueprints
of their own over the serving core (serving.py).
"""
from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify

from appliance.engine.reasoning import has_thinking_switch
from appliance.errors import EngineUnavailable, InvalidRequest

from . import serving

bp = Blueprint("api", __name__)


def _model_card(name: str) -> dict[str, Any]:
    pool = serving.pool()
    state = pool.state_of(name)
    spec = pool.spec(name)
    # aliases (every --model-alias name, its id first) and tags as llama-server lists them
    card: dict[str, Any] = {"id": name, "aliases": list(spec.aliases), "tags": list(spec.tags), "object": "model",
                            "created": serving.state().started, "owned_by": "appliance", "status": {"value": state}}
    engine = pool.client(name)
    info = engine.info if engine is not None and state == "loaded" else None
    if info is not None:
        card["context_length"] = info.n_ctx
        card["meta"] = {"arch": info.arch, "n_ctx_train": info.n_ctx_train, "n_vocab": info.n_vocab,
                        "n_slots": info.n_slots, "backend": info.backend, "vision": "mmproj" in info.settings}
    return card


@bp.get("/v1/models")
def models():
    return jsonify({"object": "list", "data": [_model_card(name) for name in serving.pool().names()]})


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str):
    return jsonify(_model_card(serving.pool().resolve(model_id, exact=True)))


@bp.post("/api/models/load")
def load_model():
    body = serving.read_body()
    pool = serving.pool()
    name = pool.resolve(_required_model(body), exact=True)
    t0 = time.perf_counter()
    engine = pool.load(name)
    return jsonify({"model": name, "state": pool.state_of(name), "n_ctx": engine.info.n_ctx,
                    "load_s": round(time.perf_counter() - t0, 3)})


@bp.post("/api/models/unload")
def unload_model():
    pool = serving.pool()
    name = pool.resolve(_required_model(serving.read_body()), exact=True)
    return jsonify({"model": name, "unloaded": pool.unload(name), "state": pool.state_of(name)})


def _required_model(body: dict[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str):
        raise InvalidRequest("'model' (a string) names the model", param="model")
    return name


@bp.get("/openapi.json")
def openapi_json():
    engine = serving.state().engine
    if engine is None:
        raise EngineUnavailable(f"the default model {serving.pool().default} is not loaded")
    # the builder is handed over by create_app: openapi.py describes every API, this one included
    build = current_app.config["OPENAPI_BUILD"]
    return jsonify(build(engine.info.model_name, serving.n_ctx(engine), engine.info.n_vocab))


@bp.get("/metrics")
def metrics():
    return Response(serving.state().metrics.render(), mimetype=None,
                    headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@bp.get("/health")
def health():
    """The default model's engine as before, and every model's state under "models". With
    several models, a default model that is not loaded is no failure (it loads on request).
    "exposed" and "warnings" say when the network gets all of it without a key; a caller
    without the key hears neither, as a server with a key is never exposed."""
    state, pool = serving.state(), serving.pool()
    engine = state.engine
    body: dict[str, Any] = {"status": "draining" if state.draining else "ok",
                            "uptime_s": round(time.time() - state.started, 1)}
    if engine is not None:
        st = engine.state
        body.update(engine_pid=st.pid, restarts=st.restarts)
        if st.status != "ready" and not state.draining:
            body["status"] = st.status
    if body["status"] == "ok" and engine is not None and engine.info is not None:
        info = engine.info
        body.update(model=info.model_name, model_fingerprint=info.fingerprint, backend=info.backend,
                    n_ctx=info.n_ctx, n_slots=info.n_slots, kv_bytes=info.kv_bytes,
                    settings=info.settings, placement=info.placement,
                    chat_template={"source": info.chat_template_source,
                                   "from_model": info.chat_template_source == "model",
                                   "thinking_switch": has_thinking_switch(info.chat_template)},
                    engine=engine.stats.as_dict() if engine.stats else {}, in_flight=pool.in_flight())
    elif body["status"] == "ok" and len(pool.names()) == 1:
        body["status"] = pool.state_of(pool.default)
    body["models"] = pool.status()
    warning = state.config.server.exposure()
    body.update(exposed=warning is not None, warnings=[warning] if warning else [])
    ok = body["status"] == "ok"
    if not ok:
        body["reason"] = (engine.state.reason if engine is not None and engine.state.reason else
                          next((m.get("reason") for m in body["models"] if m.get("reason")), None)
                          or "the server is shutting down")
    if not g.get("authorized", True):     # a monitor without the API key hears the status only
        body = {"status": body["status"], "uptime_s": body["uptime_s"]}
    resp = jsonify(body)
    if not ok:
        resp.status_code = 503
        resp.headers["Retry-After"] = "1"
    return resp
