"""The pages: chat (/), the host report (/host) and the benchmark results (/bench).

The pages and their static files carry no data and are served without the API key (with
`--api-key` set, the page asks for the key and sends it on every API call); everything they
show comes from the public endpoints beside them.
"""
from __future__ import annotations

from flask import Blueprint, render_template

bp = Blueprint("ui", __name__, template_folder="templates", static_folder="static",
               static_url_path="/static")


def _page(template: str, page: str):
    return render_template(template, page=page)


@bp.get("/")
def index():
    return _page("index.html", "chat")


@bp.get("/host")
def host():
    return _page("host.html", "host")


@bp.get("/bench")
def bench():
    return _page("bench.html", "bench")
