"""llama-server's slot routes, answered as llama-server answers them: GET /slots (each slot's
state: its request, or the last one it served, and the positions it holds) and POST
/slots/ID?action=save|restore|erase (a slot's prompt state to and from a file in
--slot-save-path, or forgotten). The engine does the work between its steps
(engine/slot_commands.py); an action on a busy slot waits for its request to end.

GET /slots answers unless --no-slots (then 501, llama-server's); the actions need
--slot-save-path (501 without it, erase included, as llama-server's). `?model=` picks a served
model, as /props does (default: the default model)."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, request

from appliance.engine.types import SlotDone, SlotState
from appliance.errors import InvalidRequest, NotSupported, QueueFull

from . import serving
from .llamaserver import Native, settings

bp = Blueprint("slots", __name__)

NO_SLOTS = "This server does not support slots endpoint. Start it with `--slots`"   # llama-server's words


def slot_json(s: SlotState) -> dict[str, Any]:
    """One slot in llama-server's shape: `id_task`, `params` and `next_token` only for a slot
    that has served a request (`next_token` a list of one object, as its server writes it)."""
    out: dict[str, Any] = {"id": s.id, "n_ctx": s.n_ctx, "speculative": s.speculative,
                           "is_processing": s.is_processing, "n_prompt_tokens": s.n_prompt_tokens}
    if s.id_task is None or s.params is None:
        return out
    params = settings(s.params, Native(n_predict=s.params.max_tokens or -1, n_probs=s.params.top_logprobs), False)
    del params["stream"]     # the engine does not know how the reply was sent
    return {**out, "id_task": s.id_task, "n_prompt_tokens_processed": s.n_prompt_tokens_processed,
            "n_prompt_tokens_cache": s.n_prompt_tokens_cache, "params": params,
            "next_token": [{"has_next_token": s.has_next_token, "has_new_line": s.has_new_line,
                            "n_remain": s.n_remain, "n_decoded": s.n_decoded}]}


def done_json(d: SlotDone) -> dict[str, Any]:
    if d.action == "erase":
        return {"id_slot": d.slot, "n_erased": d.n_tokens}
    saved = d.action == "save"
    return {"id_slot": d.slot, "filename": d.filename, ("n_saved" if saved else "n_restored"): d.n_tokens,
            ("n_written" if saved else "n_read"): d.n_bytes,
            "timings": {("save_ms" if saved else "restore_ms"): round(d.ms, 3)}}


@bp.get("/slots")
def slots():
    if not serving.state().config.server.slots:
        raise NotSupported(NO_SLOTS)
    with serving.model({"model": request.args.get("model")}) as (_, engine):
        got = engine.slots()
    if request.args.get("fail_on_no_slot") and all(s.is_processing for s in got.slots):
        raise QueueFull("no slot available", retry_after=1)
    return jsonify([slot_json(s) for s in got.slots])


@bp.post("/slots/<id_slot>")
def slot_action(id_slot: str):
    try:
        slot = int(id_slot)
    except ValueError:
        raise InvalidRequest(f"Invalid slot ID {id_slot!r}: a slot's number", param="id_slot") from None
    action = request.args.get("action", "")
    named = action in ("save", "restore")
    body = serving.read_body() if request.content_length or named else {}   # erase needs none
    filename = body.get("filename", None if named else "")
    serving.need(isinstance(filename, str), "'filename' is required: the name of a file in --slot-save-path",
                 "filename")
    with serving.model({"model": request.args.get("model")}) as (_, engine):
        done = engine.slot_action(slot, action, filename)
    return jsonify(done_json(done))
