"""What `serve` can serve: with `--model PATH` that one file; else the embedded model, the
library's models and the GGUFs under `--models-dir`, each with its own settings.

Per-model settings live in `settings.toml` in the library's directory, one table per model:

    ["Qwen3-30B-A3B-Q4_K_M"]
    n_ctx = 32768
    n_slots = 2
    kv_type = "q8_0"

Any `EngineConfig` field but `model` and `model_alias` may be set; a flag or APPLIANCE_*
variable given to `serve` wins over the file.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, EngineConfig
from .index import Library

log = logging.getLogger("appliance.library")

SETTINGS = "settings.toml"
_NOT_SETTINGS = {"model", "model_alias"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    source: str
    settings: tuple[tuple[str, object], ...] = ()    # from settings.toml, as applied

    def engine_config(self, config: Config, cache_subdir: bool) -> EngineConfig:
        """The engine settings of this model: serve's, then its own where serve's were not given.
        `cache_subdir`: its prompt-cache disk tier in a directory of its own (the disk tier
        deletes another model's files at start, so models never share one)."""
        own = {k: v for k, v in self.settings if k not in config.given}
        cfg = dataclasses.replace(config.engine, model=str(self.path), model_alias=self.name, **own)
        if cache_subdir:
            safe = re.sub(r"[^\w.-]", "_", self.name)
            cfg = dataclasses.replace(cfg, cache_dir=str(cfg.resolved_cache_dir() / "models" / safe))
        return cfg


def load_settings(root: Path) -> dict[str, dict[str, object]]:
    """`settings.toml` of the library (empty when there is none). ValueError names the file, the
    model and the key of a mistake."""
    path = root / SETTINGS
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
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
    from ..models import EMBEDDED_ALIAS, embedded_model_path, resolve
    from ..errors import ApplianceError

    eng, srv = config.engine, config.server
    if eng.model is not None:
        ref = resolve(eng.model, eng.model_alias)
        return [ModelSpec(ref.alias, ref.path, "file")], ref.alias
    lib = Library(srv.library)
    settings = load_settings(lib.root)
    specs: dict[str, ModelSpec] = {}

    def add(name: str, path: Path, source: str) -> None:
        if name in specs:
            log.warning("%s (%s) has the name of %s (%s); it is not served", path, source, name, specs[name].path)
            return
        specs[name] = ModelSpec(name, path, source, tuple(sorted(settings.get(name, {}).items())))

    try:
        add(eng.model_alias or EMBEDDED_ALIAS, embedded_model_path(), "embedded")
    except ApplianceError as e:
        log.warning("%s", e.message)
    dirs = [Path(d.strip()) for d in srv.models_dir.split(",") if d.strip()]
    for e in [*lib.entries(), *lib.found(dirs, hf_cache=False)]:
        if e.error is None:
            add(e.name, e.path, e.source)
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
            spec.engine_config(config, False)
        except ValueError as e:
            raise ValueError(f"{lib.root / SETTINGS}: [{spec.name}]: {e}") from None
    return list(specs.values()), default
