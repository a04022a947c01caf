"""Serving the app with waitress, and shutting down gracefully.

waitress: pure Python, a thread per active request (so `http_threads` streams can be open while
only `n_slots` decode), it writes every SSE chunk as it is yielded (send_bytes=1), and with a
request lookahead it notices a client that hangs up while its request waits, which is how an
abandoned request frees its slot. http_server.py holds it to account for slow clients: a bound
on the time a request may take to arrive, on the time a reply may wait for a reader, and room
made at the connection limit by closing an idle connection.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

from waitress import wasyncore

from appliance.config import Config, ServerConfig

from . import chat_jobs, create_app, http_server

log = logging.getLogger("appliance.server")

FDS_BESIDES_CONNECTIONS = 256  # model files, the engine pipes, SQLite, logs, the listening sockets


def serve(config: Config) -> int:
    from appliance.engine.pool import ModelPool
    from appliance.library.catalog import catalog

    srv_cfg = config.server
    try:
        specs, default = catalog(config)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        tools = _tool_hub(config)
    except ValueError as e:
        log.error("%s", e)
        return 2
    pool = ModelPool(specs, default, config)
    try:
        engine = pool.load(default, srv_cfg.engine_start_timeout)
    except Exception as e:
        log.error("%s", getattr(e, "message", e))
        pool.close()
        _close(tools)
        return 1
    info = engine.info
    if len(specs) > 1:
        log.info("also served, loaded on request: %s", ", ".join(s.name for s in specs if s.name != default))
    app = create_app(config, pool, tools)
    chat_jobs.sweep_at_start(app)   # the replies a stopped server left half-written: marked cut off
    try:
        socket_map, servers, dispatcher = _listen(app, srv_cfg)
    except (OSError, ValueError) as e:     # an address this host lacks, a port in use
        log.error("cannot listen on %s: %s", _listen_on(srv_cfg), e)
        pool.close()
        _close(tools)
        return 1
    urls = ", ".join(f"http://{_address(s.effective_host, s.effective_port)}" for s in servers)
    announce(info.model_name, urls, srv_cfg)
    try:
        _run(app, servers, socket_map, srv_cfg)
    finally:
        dispatcher.shutdown()
        wasyncore.close_all(socket_map)
        pool.close()
        _close(tools)
    log.info("stopped")
    return 0


def _tool_hub(config: Config):
    """The MCP servers' hub, connecting in the background (None when none is configured)."""
    from .tools import configured

    specs = configured(config)
    if not specs:
        return None
    from appliance.mcp.hub import ToolHub

    log.info("MCP servers: %s", ", ".join(f"{s.name} ({s.transport})" for s in specs))
    return ToolHub(specs)


def _close(tools) -> None:
    if tools is not None:
        tools.close()


def _listen_on(cfg: ServerConfig) -> str:
    return " ".join(_address(host, cfg.port) for host in cfg.hosts())


def _listen(app, cfg: ServerConfig):
    """waitress's sockets on every address, as many connections as this process may open files for."""
    connection_limit = cfg.max_connections
    fd_limit = http_server.raise_fd_limit(connection_limit + FDS_BESIDES_CONNECTIONS)
    if fd_limit < connection_limit + FDS_BESIDES_CONNECTIONS:
        connection_limit = max(16, fd_limit - FDS_BESIDES_CONNECTIONS)
        log.warning("max_connections lowered to %d: this process may open only %d files", connection_limit, fd_limit)
    return http_server.create(app, _listen_on(cfg), threads=cfg.http_threads, connection_limit=connection_limit,
                              request_timeout=cfg.request_timeout, send_timeout=cfg.send_timeout)


def _run(app, servers, socket_map, cfg: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain: refuse new requests, finish those in flight."""
    stopping = threading.Event()
    pool = app.extensions["appliance"].pool

    def drain(signum, _frame):
        state = app.extensions["appliance"]
        if state.draining:
            return
        state.draining = True
        log.info("signal %d: refusing new requests, finishing %d in flight (up to %.0f s)",
                 signum, pool.in_flight(), cfg.shutdown_grace)
        threading.Thread(target=_finish, args=(pool, cfg.shutdown_grace, stopping), daemon=True).start()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    # waitress's own run() loops until every socket is closed; this loop also stops
    # when draining is over, while still answering (503) whoever connects meanwhile
    while not stopping.is_set():
        for s in servers:
            s.make_room()
        wasyncore.loop(timeout=0.2, map=socket_map, use_poll=True, count=1)


def announce(model: str, urls: str, cfg: ServerConfig) -> None:
    """The start-up line on stdout, and beside it, loudly, what a server without a key on a
    network address gives away (also logged as a warning, and in /health)."""
    print(f"appliance: serving {model} at {urls}  (chat page at /, OpenAI API at /v1)", flush=True)
    if warning := cfg.exposure():
        log.warning("%s", warning)
        print(f"appliance: WARNING: {warning}", flush=True)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _finish(pool, grace: float, stopping: threading.Event) -> None:
    deadline = time.monotonic() + grace
    while pool.in_flight() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)  # let the last chunks reach their sockets
    stopping.set()
