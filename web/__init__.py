"""The web layer: `create_app(config)` builds the Flask app over an engine client.

Per-app state lives in `app.extensions["appliance"]`; typed errors are mapped to HTTP once,
by http_errors.py's handlers, registered here. Nothing in `appliance/` imports this package.
"""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flask import Flask, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from appliance import __version__
from appliance.config import Config, ServerConfig
from appliance.engine.pool import ModelPool
from appliance.engine.process import EngineClient
from appliance.errors import ApplianceError, Forbidden, Unauthorized

from . import openapi_apis, origins
from .http_errors import error_response, http_error, unexpected
from .metrics import Metrics

if TYPE_CHECKING:
    from appliance.mcp.hub import ToolHub

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
ALLOW_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"


@dataclass
class AppState:
    config: Config
    pool: ModelPool
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False

    @property
    def engine(self) -> EngineClient | None:
        """The default model's engine (None while it is not loaded)."""
        return self.pool.client()

    @staticmethod
    def fingerprint(engine: EngineClient) -> str:
        info = engine.info
        return f"appliance-{__version__}-{info.fingerprint if info else ''}"


def create_app(config: Config, pool: ModelPool, tools: ToolHub | None = None) -> Flask:
    """The app over `pool`; `tools`: the MCP servers' hub (web/tools.py), None without servers."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    app.config["OPENAPI_BUILD"] = openapi_apis.build
    app.json.sort_keys = False

    def default(attr: str):
        engine = pool.client()
        return getattr(engine, attr) if engine is not None else None

    metrics = Metrics(lambda: default("stats"), lambda: default("info"), lambda: pool.engine_pids())
    app.extensions["appliance"] = AppState(config, pool, metrics)
    app.extensions["appliance.tools"] = tools

    from .anthropic import bp as anthropic_bp
    from .api import bp as api_bp
    from .openai_chat import bp as openai_bp
    from .benchruns import bp as bench_bp
    from .chat_jobs import bp as chat_jobs_bp
    from .conversations import bp as conversations_bp
    from .documents import bp as documents_bp
    from .embeddings import bp as embeddings_bp
    from .hostreport import bp as host_bp
    from .llamaserver import bp as llamaserver_bp
    from .ollama import bp as ollama_bp
    from .slots import bp as slots_bp
    from .openai_responses import bp as openai_responses_bp
    from .lora_adapters import bp as lora_bp
    from .tokens import bp as tokens_bp
    from .tools import bp as tools_bp
    from .ui import bp as ui_bp

    for bp in (api_bp, openai_bp, embeddings_bp, anthropic_bp, openai_responses_bp, ollama_bp, llamaserver_bp, slots_bp,
               tokens_bp, lora_bp, conversations_bp, tools_bp, documents_bp, chat_jobs_bp, host_bp, bench_bp, ui_bp):
        app.register_blueprint(bp)
    app.before_request(_start_clock)
    app.before_request(_guard)
    app.after_request(_cors)
    app.after_request(_count)
    app.register_error_handler(ApplianceError, error_response)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, unexpected)
    return app


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host.split("]")[0] + "]"
    return host.rsplit(":", 1)[0]


def _guard() -> Response | None:
    cfg = current_app.extensions["appliance"].config.server
    if cfg.loopback_only():
        # DNS rebinding: a page on another origin resolving its name to 127.0.0.1
        if _host_name(request.host or "").lower() not in LOCAL_HOSTS:
            raise Forbidden(f"Host '{request.host}' is not allowed on a server bound to {cfg.host}")
    origin = _origin()
    if origin and not origins.allowed(origin, request.host or "", cfg.cors_origins):
        # a page of another site (web/origins.py): refused whatever the method or content type
        raise Forbidden(f"the Origin '{origin}' may not use this server: it serves pages of its own "
                        "origin, of this machine and those --cors-origins (APPLIANCE_CORS_ORIGINS) lists")
    if request.method == "OPTIONS" and origin:
        return Response(status=204)    # a preflight: _cors adds the Access-Control-Allow-* headers
    endpoint = request.endpoint or ""
    if cfg.api_key and not (endpoint == "static" or endpoint.startswith("ui.")):
        # the pages and their static files carry no data: the page asks for the key itself
        auth = request.headers.get("Authorization", "")
        given = (auth[7:] if auth.lower().startswith("bearer ") else
                 request.headers.get("x-api-key") or request.cookies.get("appliance_key", ""))
        g.authorized = hmac.compare_digest(given.encode(), cfg.api_key.encode())
        # /health answers a monitor without the key, with its status only (api.health)
        if not g.authorized and endpoint != "api.health":
            raise Unauthorized("a valid API key is required: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')")
    return None


def _start_clock() -> None:
    g.t0 = time.perf_counter()


def _count(resp: Response) -> Response:
    endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
    current_app.extensions["appliance"].metrics.requests.labels(endpoint, str(resp.status_code)).inc()
    return resp


def _origin() -> str:
    return request.headers.get("Origin", "").strip()


def _cors(resp: Response) -> Response:
    cfg: ServerConfig = current_app.extensions["appliance"].config.server
    origin = _origin()
    if origin and origins.allowed(origin, request.host or "", cfg.cors_origins):
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Vary"] = "Origin"
        # an allowed page may send what its SDK sends (x-stainless-*, anthropic-dangerous-...)
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers",
                                                                           ALLOW_HEADERS)
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
    return resp
