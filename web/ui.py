"""The UI blueprint: one chat page that streams replies from the API it sits beside."""
from __future__ import annotations

from flask import Blueprint, current_app, render_template

bp = Blueprint("ui", __name__, template_folder="templates", static_folder="static",
               static_url_path="/static")


@bp.get("/")
def index():
    engine = current_app.extensions["appliance"].engine
    info = engine.info if engine is not None else None
    return render_template("index.html", model=info.model_name if info else "(loading)",
                           n_ctx=info.n_ctx if info else 0)
