"""The library on disk: `library.json` under the models directory records each pulled model
(its files, size, card and where it came from); GGUFs in the Hugging Face cache and in extra
directories are found, read and listed beside them, but never recorded or removed.

    <models dir>/library.json
    <models dir>/<ORG>/<REPO>/<file>.gguf        (a split model's parts together)
    <models dir>/<ORG>/<REPO>/<file>.gguf.part   (a download under way or interrupted)

Writes go through a lock file and an atomic rename, so two commands never lose each other's
entry and a crash never leaves a half-written index.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from ..fit.gguf_header import read_header
from ..fit.model import split_parts
from .card import Card, card_of
from .refs import groups, model_name, projector

INDEX = "library.json"
ENV_DIR = "APPLIANCE_LIBRARY"          # as `serve --library` reads it (config.ServerConfig)


def default_root(env: dict[str, str] | None = None) -> Path:
    """$APPLIANCE_LIBRARY, else `models` in the appliance's data directory."""
    from ..config import default_data_dir

    env = dict(os.environ) if env is None else env
    return Path(env[ENV_DIR]).expanduser() if env.get(ENV_DIR) else default_data_dir(env) / "models"


@dataclass(frozen=True)
class Entry:
    """One model the appliance can serve. `source` is `hf:ORG/REPO` (pulled), `embedded`,
    `hf-cache:ORG/REPO` or `dir:PATH` (found); `error` says why a listed file cannot be read."""

    name: str
    path: Path                                  # the file to load: the first part of a split
    files: tuple[Path, ...]
    size: int
    card: Card | None
    source: str
    in_library: bool = False
    origin: dict = field(default_factory=dict, compare=False)
    error: str | None = None
    mmproj: Path | None = None                  # its vision projector, pulled with it (in `files` too)
    mtp: Path | None = None                     # its MTP head's sidecar, pulled with it (in `files` too)

    def to_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "files": [str(f) for f in self.files],
                "size": self.size, **(self.card.to_dict() if self.card else {}), "source": self.source,
                "in_library": self.in_library, **({"origin": self.origin} if self.origin else {}),
                **({"error": self.error} if self.error else {}), "vision": self.mmproj is not None,
                **({"mmproj": str(self.mmproj)} if self.mmproj else {}),
                **({"mtp": str(self.mtp)} if self.mtp else {})}


def read_card(first: Path) -> tuple[Card | None, int, tuple[Path, ...], str | None]:
    """(card, bytes, files, error) of the model whose first file is `first`."""
    parts = split_parts(first)
    files = tuple(parts if len(parts) > 1 and all(p.is_file() for p in parts) else [first])
    size = sum(p.stat().st_size for p in files if p.is_file())
    try:
        headers = [read_header(p) for p in files]
    except (OSError, ValueError) as e:
        return None, size, files, str(e)
    return card_of(headers[0][0], [t for _, infos in headers for t in infos]), size, files, None


class Library:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self._lock = FileLock(str(self.root / ".library.lock"))

    # -- the index ------------------------------------------------------------------------
    def _read(self) -> dict:
        try:
            data = json.loads((self.root / INDEX).read_text())
        except FileNotFoundError:
            return {"version": 1, "models": {}}
        except ValueError as e:
            raise OSError(f"{self.root / INDEX} is not JSON it can read ({e}); move it away to start "
                          "a new library") from None
        data.setdefault("models", {})
        return data

    def _write(self, data: dict) -> None:
        tmp = self.root / f".{INDEX}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.root / INDEX)

    def entries(self) -> list[Entry]:
        out = []
        for name, rec in sorted(self._read()["models"].items()):
            files = tuple(self.root / f for f in rec["files"])
            missing = [str(f) for f in files if not f.is_file()]
            card = Card(**{k: rec[k] for k in ("quant", "arch", "n_ctx_train", "chat_template", "n_params")},
                        rope_scaling=rec.get("rope_scaling", ""))
            out.append(Entry(name, files[0], files, rec["size"], card, rec["source"], True, rec.get("origin", {}),
                             f"file missing: {', '.join(missing)}" if missing else None,
                             *(self.root / rec[k] if rec.get(k) else None for k in ("mmproj", "mtp"))))
        return out

    def get(self, name: str) -> Entry | None:
        return next((e for e in self.entries() if e.name == name), None)

    def add(self, name: str, files: list[Path], source: str, origin: dict, mmproj: Path | None = None,
            mtp: Path | None = None) -> Entry:
        """Record a model whose files are in place under the root (read from their headers),
        with its vision projector and its MTP head's sidecar when it has them."""
        card, size, _, error = read_card(files[0])
        if card is None:
            raise ValueError(f"{files[0]}: not a GGUF it can read: {error}")
        sidecars = {k: p for k, p in (("mmproj", mmproj), ("mtp", mtp)) if p}
        files = [*files, *sidecars.values()]
        rec = {"files": [str(Path(f).relative_to(self.root)) for f in files],
               "size": size + sum(p.stat().st_size for p in sidecars.values()), **card.to_dict(),
               "source": source, "origin": origin, "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               **{k: str(p.relative_to(self.root)) for k, p in sidecars.items()}}
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = self._read()
            data["models"][name] = rec
            self._write(data)
        return self.get(name)  # type: ignore[return-value]

    def remove(self, name: str) -> Entry:
        """Delete a pulled model's files and its record. KeyError if it is not in the library."""
        with self._lock:
            data = self._read()
            if name not in data["models"]:
                raise KeyError(name)
            entry = next(e for e in self.entries() if e.name == name)
            for f in entry.files:
                f.unlink(missing_ok=True)
                Path(f"{f}.part").unlink(missing_ok=True)
            del data["models"][name]
            self._write(data)
        for d in {f.parent for f in entry.files}:
            while d != self.root and d.is_relative_to(self.root):
                try:
                    d.rmdir()           # only an empty directory goes
                except OSError:
                    break
                d = d.parent
        return entry

    def name_for(self, path: str, repo: str) -> str:
        """The file's model name, unless another model has it; then ORG-REPO-name."""
        name = model_name(path)
        taken = self.get(name)
        if taken is None or taken.origin.get("repo") == repo:
            return name
        return f"{repo.replace('/', '-')}-{name}"

    # -- models found, not recorded -------------------------------------------------------
    def found(self, dirs: list[Path] = (), hf_cache: bool = True) -> list[Entry]:
        """GGUF models in the Hugging Face cache and in `dirs`, other than the library's own."""
        own = {e.path.resolve() for e in self.entries()}
        seen: set[Path] = set()
        out = []
        for first, source, mmproj in [*(_hf_cache_models() if hf_cache else []), *_dir_models(dirs)]:
            real = first.resolve()
            if real in own or real in seen:
                continue
            seen.add(real)
            card, size, files, error = read_card(first)
            out.append(Entry(model_name(first.name), first, files, size, card, source, error=error, mmproj=mmproj))
        return out


def _dir_models(dirs: list[Path]) -> list[tuple[Path, str, Path | None]]:
    """(first file, source, projector) of each model under `dirs`. A projector goes with a model
    as llama-server's --models-dir lays them out: the model alone in a subdirectory, with an
    mmproj*.gguf beside it."""
    out = []
    for d in dirs:
        d = Path(d).expanduser()
        paths = [str(p.relative_to(d)) for p in d.rglob("*.gguf") if p.is_file()]
        models = groups(paths)
        for first in models:
            folder = first.rpartition("/")[0]
            alone = folder and [m.rpartition("/")[0] for m in models].count(folder) == 1
            mm = projector(paths, first) if alone else None
            out.append((d / first, f"dir:{d}", d / mm if mm else None))
    return out


def _hf_cache_models() -> list[tuple[Path, str]]:
    """GGUFs of the model repositories in the Hugging Face cache (huggingface_hub's own scan)."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    # as the environment says now (huggingface_hub reads it once, at import)
    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (str(Path(home) / "hub") if home else constants.HF_HUB_CACHE)
    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            by_name = {str(f.file_path.relative_to(rev.snapshot_path)): f.file_path for f in rev.files}
            for first in groups(list(by_name)):   # a repository's projector goes with its models, as pull's
                mm = projector(list(by_name), first)
                out.append((by_name[first], f"hf-cache:{repo.repo_id}", by_name[mm] if mm else None))
    return out
