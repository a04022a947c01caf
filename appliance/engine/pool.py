"""Several models behind one server: one engine process per loaded model, loaded on request.

    ModelPool.acquire(name)  -> the model's EngineClient, loading it first if it is not loaded
                                (concurrent first requests share one load); a load that must
                                make room unloads the least recently used idle model first
    ModelPool.release(name)  -> the request is submitted (its stream keeps the model busy)
    ModelPool.load/unload    -> POST /api/models/load and /unload
    reaper thread            -> unloads a model idle past its keep_alive

Each model is its own `EngineClient` (process.py): its own process, supervisor and restarts, so
a crash in one never touches another. A model is busy while a request holds a lease (acquired,
not yet submitted) or has a stream open; a busy model is never unloaded. Room is counted in
models (`--max-loaded`) and in host memory: a loaded model takes its weights, its engine's
reported KV pool and the fit planner's compute estimate; a model not loaded, the fit planner's
whole estimate. The default model is never unloaded for being idle, only to make room or when
asked. An embedding model (--embedding-model PATH) is a model of kind "embedding", whose engine
only embeds; `resolve_embedding` picks the model that answers an embeddings request.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ApplianceError, EngineUnavailable, InvalidRequest, ModelLoadError, ModelNotFound
from .process import EngineClient

if TYPE_CHECKING:
    from ..config import Config, EngineConfig
    from ..library.catalog import ModelSpec

log = logging.getLogger("appliance.pool")

GIB = 1 << 30
REAP_S = 0.5


@dataclass
class _Model:
    spec: "ModelSpec"
    cfg: "EngineConfig"
    client: EngineClient | None = None
    leases: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None     # seconds, from the last request that gave one; < 0: forever
    failure: str | None = None
    failed_file: tuple[int, int] | None = None
    closing: threading.Event | None = None
    load_started: float | None = None
    load_s: float | None = None
    loads: int = 0
    footprint: tuple[int, int, int] | None = None   # planner: weights, KV, compute bytes
    ready: threading.Event = field(default_factory=threading.Event)


def _file_id(m: _Model) -> tuple[int, int] | None:
    try:
        st = m.spec.path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return None


class ModelPool:
    def __init__(self, specs: list["ModelSpec"], default: str, config: "Config") -> None:
        self.config, self.default = config, default
        srv = config.server
        self.max_loaded, self.idle_unload = srv.max_loaded, srv.idle_unload
        self.log_level, self.load_timeout = srv.log_level, srv.engine_start_timeout
        self.fallback = srv.default_model_fallback
        self._models = {s.name: _Model(s, s.engine_config(config, s.name == default)) for s in specs}
        # --model-alias's other names (a model's own name wins over another's alias)
        self._aliases = {a: s.name for s in specs for a in s.aliases if a not in self._models}
        # engines that may compute at once take turns at the cores (cores.Turns)
        shared = len(specs) > 1 and self.max_loaded != 1
        self._turns_dir = tempfile.mkdtemp(prefix="appliance-cores-") if shared else None
        self.turns = os.path.join(self._turns_dir, "turns.lock") if self._turns_dir else None
        self._n_chat = sum(s.kind == "chat" for s in specs)
        self._lock = threading.Lock()
        self._closing = False
        self.budget = _host_budget()
        self._reaper = threading.Thread(target=self._reap, name="model-reaper", daemon=True)
        self._reaper.start()

    # -- names ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._models)

    def resolve(self, model: object, exact: bool = False) -> str:
        """The served model a request's "model" names: its name, one of its --model-alias names or
        its file name; None is the default (a non-string is left to the request's own validation).
        Any other name is the only chat model when one is served (tools send fixed names such as
        gpt-4o-mini, as llama-server allows), the default one under --default-model-fallback, else
        a ModelNotFound listing what is served; `exact` (load, unload, retrieve, and Ollama's API,
        whose clients pull a model they miss) always refuses it."""
        if model is None or not isinstance(model, str):
            return self.default
        if model in self._models:
            return model
        if model in self._aliases:
            return self._aliases[model]
        if model.endswith(".gguf") and model[:-5] in self._models:
            return model[:-5]
        if not exact and (self._n_chat == 1 or self.fallback):
            return self.default
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves {', '.join(self._models)}",
                            param="model")

    def spec(self, name: str) -> "ModelSpec":
        """What is served under `name` (its file, aliases, tags, settings)."""
        return self._models[name].spec

    def kind(self, name: str) -> str:
        """chat, or embedding: a model that only embeds (--embedding-model PATH)."""
        return self._models[name].spec.kind

    def resolve_embedding(self, model: object) -> str:
        """The model that answers an embeddings request naming `model`: the served model it names
        if that one embeds (an embedding model; any model under --embedding-model chat); for no
        name or an unknown one (clients send text-embedding-3-small), the embedding model, or under
        --embedding-model chat the default model, or the one model served whatever its name, as
        chat's rule has it (with several, an unknown name is a 404). InvalidRequest names the flag
        when none embeds."""
        own = [n for n, m in self._models.items() if m.spec.kind == "embedding"]
        chat = self.config.engine.embedding_model == "chat"
        if isinstance(model, str):
            try:
                name = self.resolve(model, exact=True)
            except ModelNotFound:
                if chat and not own:
                    return self.resolve(model)   # one model served: any name is it
                name = None
            if name is not None:
                if chat or self.kind(name) == "embedding":
                    return name
                raise InvalidRequest(f"the model {name} is a chat model and does not answer embeddings: serve an "
                                     "embedding model with --embedding-model PATH.gguf, or start the server with "
                                     "--embedding-model chat to embed with the chat model's mean-pooled hidden "
                                     "state", param="model")
        if own:
            return own[0]
        if chat:
            return self.default
        raise InvalidRequest("this server serves no embedding model: start it with --embedding-model PATH.gguf (an "
                             "embedding model) or --embedding-model chat (the chat model's mean-pooled hidden state)",
                             param="model")

    def client(self, name: str | None = None) -> EngineClient | None:
        """The model's engine if it is loaded or loading (never loads it)."""
        return self._models[name or self.default].client

    # -- loading ----------------------------------------------------------------------------
    def acquire(self, name: str, keep_alive: float | None = None, timeout: float | None = None) -> EngineClient:
        """The model's ready engine, loaded first if need be, with a lease that keeps it loaded
        until `release(name)` (call it once the request is submitted, or has failed)."""
        m = self._models[name]
        with self._lock:
            if self._closing:
                raise EngineUnavailable("the server is shutting down")
            self._settle(m)
            start, wait_for = m.client is None, []
            if start:
                if m.failure is not None and m.failed_file == _file_id(m):
                    raise ModelLoadError(f"the model {name} could not be loaded: {m.failure}")
                wait_for = self._make_room(m)
                if m.closing is not None:
                    wait_for.append(m.closing)
                m.client = EngineClient(m.cfg, self.log_level, embedding_only=m.spec.kind == "embedding",
                                        turns=self.turns)
                m.failure, m.load_started = None, time.monotonic()
                m.ready.clear()
            m.leases += 1
            m.last_used = time.monotonic()
            if keep_alive is not None:
                m.keep_alive = keep_alive
            client = m.client
        try:
            if start:
                for ev in wait_for:        # the memory of what was unloaded is free first
                    ev.wait()
                log.info("loading %s (%s)", name, m.spec.path)
                client.start()
            client.wait_ready(self.load_timeout if timeout is None else timeout)
        except ApplianceError as e:
            failed = client.state.status == "failed"
            reason = client.state.reason
            with self._lock:
                m.leases -= 1
                self._settle(m)
            if failed or m.failure is not None:
                raise ModelLoadError(f"the model {name} could not be loaded: {m.failure or reason}") from None
            raise EngineUnavailable(f"the model {name} is still loading: {e.message}") from None
        if start:
            m.load_s, m.loads = time.monotonic() - (m.load_started or 0), m.loads + 1
            m.ready.set()
            log.debug("loaded %s in %.1f s", name, m.load_s)   # the engine said it, with its figures
        return client

    def release(self, name: str) -> None:
        m = self._models[name]
        with self._lock:
            m.leases = max(0, m.leases - 1)
            m.last_used = time.monotonic()

    def load(self, name: str, timeout: float | None = None) -> EngineClient:
        client = self.acquire(name, timeout=timeout)
        self.release(name)
        return client

    def unload(self, name: str) -> bool:
        """Unload the model unless it is busy (EngineUnavailable then); False if it was not loaded."""
        m = self._models[name]
        with self._lock:
            self._settle(m)
            if m.client is None:
                return False
            if self._busy(m):
                raise EngineUnavailable(f"the model {name} is busy ({m.client.in_flight()} requests in flight); "
                                        "it is unloaded when asked again after they finish")
            done = self._unload(m, "asked to")
        done.wait()
        return True

    def _settle(self, m: _Model) -> None:
        """A client whose engine failed to load is dropped; its reason stays until the file changes."""
        if m.client is not None and m.client.state.status == "failed":
            m.failure, m.failed_file = m.client.state.reason, _file_id(m)
            client, m.client = m.client, None
            threading.Thread(target=client.close, daemon=True).start()

    def _busy(self, m: _Model) -> bool:
        return m.leases > 0 or (m.client is not None and m.client.in_flight() > 0)

    def _unload(self, m: _Model, why: str) -> threading.Event:
        client, m.client = m.client, None
        done = threading.Event()
        m.closing, m.ready = done, threading.Event()
        log.info("unloading %s (%s)", m.spec.name, why)

        def close() -> None:
            try:
                client.close()
            finally:
                done.set()

        threading.Thread(target=close, name=f"unload-{m.spec.name}", daemon=True).start()
        return done

    # -- room -------------------------------------------------------------------------------
    def _estimate(self, m: _Model) -> tuple[int, int, int]:
        """(weights, KV, compute) bytes by the fit planner, from the file's header."""
        if m.footprint is None:
            m.footprint = _plan_bytes(m.cfg, m.spec.path)
        return m.footprint

    def _bytes(self, m: _Model) -> int:
        weights, kv, compute = self._estimate(m)
        info = m.client.info if m.client is not None else None
        return weights + (info.kv_bytes if info is not None else kv) + compute

    def _make_room(self, m: _Model) -> list[threading.Event]:
        """Unload idle models, least recently used first, until `m` fits the count and the
        memory; EngineUnavailable (with the numbers) when only busy models are left."""
        freed = []
        need = self._bytes(m)
        while True:
            loaded = [x for x in self._models.values() if x.client is not None and x is not m]
            used = sum(self._bytes(x) for x in loaded)
            over_count = self.max_loaded and len(loaded) >= self.max_loaded
            over_memory = loaded and used + need > self.budget
            if not over_count and not over_memory:
                if not loaded and need > self.budget:
                    log.warning("%s needs %.1f GiB by the fit planner, more than the %.1f GiB host budget; "
                                "loading it anyway (llama.cpp maps the weights)", m.spec.name, need / GIB,
                                self.budget / GIB)
                return freed
            idle = [x for x in loaded if not self._busy(x)]
            if not idle:
                why = (f"--max-loaded {self.max_loaded} models are loaded" if over_count else
                       f"it needs {need / GIB:.2f} GiB and {used / GIB:.2f} GiB of the {self.budget / GIB:.2f} GiB "
                       "host budget are held")
                raise EngineUnavailable(f"cannot load {m.spec.name} now: {why}, and every loaded model is busy "
                                        f"({', '.join(x.spec.name for x in loaded)}); try again when one finishes")
            victim = min(idle, key=lambda x: x.last_used)
            freed.append(self._unload(victim, f"making room for {m.spec.name}"))

    def _reap(self) -> None:
        while not self._closing:
            time.sleep(REAP_S)
            now = time.monotonic()
            with self._lock:
                for m in self._models.values():
                    if m.leases:            # a request is loading or submitting to it: acquire settles it
                        continue
                    self._settle(m)
                    if m.client is None or self._busy(m) or not m.ready.is_set():
                        continue
                    keep = m.keep_alive if m.keep_alive is not None else (
                        None if m.spec.name == self.default or not self.idle_unload else self.idle_unload)
                    if keep is not None and keep >= 0 and now - m.last_used >= keep:
                        self._unload(m, f"idle for {now - m.last_used:.0f} s (keep_alive {keep:g} s)")

    # -- state ------------------------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(m.client.in_flight() for m in self._models.values() if m.client is not None)

    def engine_pids(self) -> dict[str, int]:
        """Each loaded (or loading) model's engine process id, for /metrics."""
        return {name: m.client.state.pid for name, m in list(self._models.items())
                if m.client is not None and m.client.state.pid is not None}

    def state_of(self, name: str) -> str:
        m = self._models[name]
        if m.client is None:
            return "failed" if m.failure is not None else "unloaded"
        status = m.client.state.status
        return {"starting": "loading", "ready": "loaded"}.get(status, status)

    def status(self) -> list[dict]:
        out = []
        now = time.monotonic()
        with self._lock:
            for name, m in self._models.items():
                state = self.state_of(name)
                info = m.client.info if m.client is not None and state == "loaded" else None
                row = {"name": name, "state": state, "default": name == self.default, "kind": m.spec.kind,
                       "source": m.spec.source,
                       "path": str(m.spec.path), "settings": dict(m.spec.settings), "loads": m.loads}
                if m.failure is not None and state == "failed":
                    row["reason"] = m.failure
                if info is not None:
                    row.update(pid=m.client.state.pid, n_ctx=info.n_ctx, n_slots=info.n_slots, kv_bytes=info.kv_bytes,
                               in_flight=m.client.in_flight(), idle_s=round(now - m.last_used, 1),
                               load_s=round(m.load_s, 2) if m.load_s is not None else None)
                    if "embeddings" in info.settings:    # it embeds: pooling, size, batch limits
                        row["embeddings"] = info.settings["embeddings"]
                out.append(row)
        return out

    def close(self) -> None:
        with self._lock:
            self._closing = True
            closing = [self._unload(m, "the server is stopping") for m in self._models.values()
                       if m.client is not None]
        for done in closing:
            done.wait()
        if self._turns_dir:
            shutil.rmtree(self._turns_dir, ignore_errors=True)


def _host_budget() -> int:
    """Host memory the models may take: total less the OS's share, at most what is available."""
    import psutil

    from ..fit.devices import from_measured

    vm = psutil.virtual_memory()
    return from_measured(vm.total, vm.available, [])[0].budget


def _plan_bytes(cfg: "EngineConfig", path) -> tuple[int, int, int]:
    """(weights, KV, compute) of a model as `cfg` would serve it on the CPU, by the fit planner;
    the file's size alone when its header cannot be read (its load will say why)."""
    from ..fit.planner import projector_of
    from ..fit.devices import Device
    from ..fit.model import from_gguf
    from ..fit.planner import FitRequest, place
    from ..rope import positions_of

    try:
        m = from_gguf(path)
    except (OSError, ValueError):
        try:
            return path.stat().st_size, 0, 0
        except OSError:
            return 0, 0, 0
    n_ctx = positions_of(cfg, m.positions) or 4096
    req = FitRequest(n_ctx=n_ctx, n_slots=cfg.n_slots, kv_type=cfg.kv_type, n_ubatch=cfg.n_ubatch,
                     flash_attn=cfg.flash_attn or cfg.kv_type != "f16", projector=projector_of(cfg))
    use = place(m, req, [Device("CPU", "cpu", 1 << 62)], 0, 0, 0).use["CPU"]
    return sum(use.weights.values()), use.kv, use.compute
