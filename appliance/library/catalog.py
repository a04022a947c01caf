"""What `serve` can serve: with `--model PATH` that one file; else the embedded model, the
library's models and the GGUFs under `--models-dir`, each with its own settings.

Per-model settings live in `settings.toml` in the library's directory, one table per model:

    ["Qwen3-30B-A3B-Q4_K_M"]
    n_ctx = 32768
    n_slots = 2
    kv_type = "q8_0"

The table `[mcp]` holds the MCP servers (mcp/settings.py). Any `EngineConfig` field but `model`, `model_alias`, `tags` and `embedding_model` may be set; a
flag or APPLIANCE_* variable given to `serve` wins over the file.

`--model-alias a,b` names the model `--model` serves (without it, the embedded model): `a` is its
id, and a request naming `b` reaches it too; `--tags` are that model's, listed by /v1/models.

`--embedding-model PATH` adds a model of kind "embedding", after the others (never the default),
which takes serve's settings and answers embeddings only.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from .. import settings_file
from ..config import Config, EngineConfig, fit_engine
from ..flags import listed
from ..fit.auto import for_file as auto_n_ctx
from ..mcp.settings import TABLE as MCP_TABLE
from ..rope import AUTO_N_CTX
from .index import Library

log = logging.getLogger("appliance.library")

SETTINGS = settings_file.SETTINGS
_NOT_SETTINGS = {"model", "model_alias", "tags", "embedding_model"}
_DEFAULT_MODEL_ONLY = ("chat_template", "chat_template_kwargs")   # serve's apply to the default model


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    source: str
    settings: tuple[tuple[str, object], ...] = ()    # from settings.toml, as applied
    kind: str = "chat"           # chat | embedding (--embedding-model PATH: it only embeds)
    aliases: tuple[str, ...] = ()   # every name --model-alias gives it, its own first; each reaches it
    tags: tuple[str, ...] = ()      # --tags: informational, as llama-server's

    def engine_config(self, config: Config, default: bool) -> EngineConfig:
        return self.fit(config, default)[0]

    def fit(self, config: Config, default: bool) -> tuple[EngineConfig, tuple[str, ...]]:
        """The engine settings of this model: serve's, then its own where serve's were not given;
        and what of serve's that were not given followed its own (`config.fit_engine`: a table
        is given too), for the log. A model but the `default` one keeps its prompt-cache disk
        tier in a directory of its own (the disk tier deletes another model's files at start, so
        models never share one), and its chat template is its own: serve's --chat-template is
        the default model's."""
        own = {k: v for k, v in self.settings if k not in config.given}
        cfg, notes = fit_engine(dataclasses.asdict(config.engine) | own, config.given | own.keys())
        cfg = dataclasses.replace(cfg, model=str(self.path), model_alias=self.name)
        if self.kind == "embedding":   # one batch of inputs is its whole context: what the planner sizes
            cfg = dataclasses.replace(cfg, n_slots=1, n_ctx=cfg.n_batch)
        elif cfg.n_ctx == AUTO_N_CTX:  # the longest that fits this host, said in the log
            n_ctx, note = auto_n_ctx(cfg, self.path)
            cfg, notes = dataclasses.replace(cfg, n_ctx=n_ctx), (*notes, note)
        if not default:
            safe = re.sub(r"[^\w.-]", "_", self.name)
            template = {k: dict(self.settings).get(k) for k in _DEFAULT_MODEL_ONLY}
            cfg = dataclasses.replace(cfg, cache_dir=str(cfg.resolved_cache_dir() / "models" / safe), **template)
        return cfg, notes


def load_settings(root: Path) -> dict[str, dict[str, object]]:
    """`settings.toml` of the library (empty when there is none). ValueError names the file, the
    model and the key of a mistake."""
    path = root / SETTINGS
    data = settings_file.read(root)
    data.pop(MCP_TABLE, None)    # the MCP servers' settings (mcp/settings.py), no model's
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - _NOT_SETTINGS
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: '{name}' must be a table of settings ([\"{name}\"])")
        for key in table:
            if key not in fields:
                raise ValueError(f"{path}: [{name}] {key}: not a model setting (one of {', '.join(sorted(fields))})")
    return data


def catalog(config: Config) -> tuple[list[ModelSpec], str]:
    """(the models to serve, the default one's name). ValueError for a setting that is wrong."""
    specs, default = _chat_models(config)
    path = config.engine.embedding_model
    if path not in (None, "chat"):
        from ..errors import ApplianceError
        from ..models import resolve

        try:
            ref = resolve(path)
        except ApplianceError as e:
            raise ValueError(f"--embedding-model {path}: {e.message}") from None
        if ref.alias in {s.name for s in specs}:
            raise ValueError(f"--embedding-model {path}: a served model is already named {ref.alias}")
        specs.append(ModelSpec(ref.alias, ref.path, "file", kind="embedding"))
    return specs, default


def _chat_models(config: Config) -> tuple[list[ModelSpec], str]:
    from ..models import EMBEDDED_ALIAS, embedded_model_path, resolve
    from ..errors import ApplianceError

    eng, srv = config.engine, config.server
    names = {"aliases": listed(eng.model_alias, "--model-alias"), "tags": listed(eng.tags, "--tags")}
    if eng.model is not None:
        ref = resolve(eng.model, names["aliases"][0] if names["aliases"] else None)
        return [ModelSpec(ref.alias, ref.path, "file", **names)], ref.alias
    lib = Library(srv.library)
    settings = load_settings(lib.root)
    specs: dict[str, ModelSpec] = {}

    def add(name: str, path: Path, source: str, mmproj: Path | None = None, mtp: Path | None = None,
            **names: tuple[str, ...]) -> None:
        if name in specs:
            log.warning("%s (%s) has the name of %s (%s); it is not served", path, source, name, specs[name].path)
            return
        pulled = {k: str(p) for k, p in (("mmproj", mmproj), ("mtp_model", mtp)) if p}
        own = {**pulled, **settings.get(name, {})}   # the file's wins
        specs[name] = ModelSpec(name, path, source, tuple(sorted(own.items())), **names)

    try:
        add(names["aliases"][0] if names["aliases"] else EMBEDDED_ALIAS, embedded_model_path(), "embedded", **names)
    except ApplianceError as e:
        log.warning("%s", e.message)
    dirs = [Path(d.strip()) for d in srv.models_dir.split(",") if d.strip()]
    for e in [*lib.entries(), *lib.found(dirs, hf_cache=False)]:
        if e.error is None:
            add(e.name, e.path, e.source, e.mmproj, e.mtp)
        else:
            log.warning("%s (%s) is not served: %s", e.name, e.path, e.error)
    unknown = sorted(set(settings) - set(specs))
    if unknown:
        log.warning("%s names models that are not served: %s", lib.root / SETTINGS, ", ".join(unknown))
    if not specs:
        raise ValueError("nothing to serve: the embedded model's package is missing, the library is empty "
                         "and no --models-dir has a GGUF; pass --model PATH.gguf")
    default = srv.default_model or next(iter(specs))
    if default not in specs:
        raise ValueError(f"--default-model {default}: no such model (served: {', '.join(specs) or 'none'})")
    for spec in specs.values():          # a wrong setting stops the start, naming its model
        try:
            notes = spec.fit(config, spec.name == default)[1]
        except ValueError as e:
            raise ValueError(f"{lib.root / SETTINGS}: [{spec.name}]: {e}") from None
        for note in notes:   # what followed settings.toml, and --n-ctx auto's choice
            where = spec.name if note.startswith("--n-ctx auto") else f"{lib.root / SETTINGS} [{spec.name}]"
            log.info("%s: %s", where, note)
    return list(specs.values()), default
