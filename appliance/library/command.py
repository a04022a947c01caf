"""`appliance pull`, `appliance models`, `appliance rm`: the model library from the shell."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .card import human_bytes, human_params

if TYPE_CHECKING:   # the hub and the index load when a command runs
    from .hub import RemoteFile
    from .index import Entry, Library
    from .refs import Ref

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _library_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--library", metavar="DIR",
                   help="the library's directory (default: $APPLIANCE_LIBRARY, else "
                        "$XDG_DATA_HOME/appliance/models)")


def add_parsers(sub) -> None:
    pull = sub.add_parser(
        "pull", help="download a GGUF model from the Hugging Face Hub into the library",
        description="Download a GGUF model from the Hugging Face Hub (HF_ENDPOINT and HF_TOKEN are "
                    "honoured) into the library: first its header (a few MiB) to say whether it fits "
                    "this machine, then the files, resumable (an interrupted pull keeps FILE.part and "
                    "the next one continues it) and checked against the sha256 the Hub lists. ORG/REPO "
                    "takes the repository's only model, else its Q4_K_M; ORG/REPO:QUANT the model of "
                    "that quant; ORG/REPO FILE.gguf that file. Split GGUFs come whole. A vision model's "
                    "projector (mmproj*.gguf beside it) comes with it, and so does the MTP head of a "
                    "model published without it (mtp-*.gguf, chosen as llama-server does); `serve` "
                    "loads them.")
    pull.add_argument("ref", metavar="ORG/REPO[:QUANT]")
    pull.add_argument("file", nargs="?", metavar="FILE.gguf", help="the file to pull (its path in the repository)")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    pull.add_argument("--name", help="the model's name in the library (default: the file's name)")
    pull.add_argument("--no-mmproj", action="store_true",
                      help="leave out the vision projector (mmproj*.gguf) of a model that has one")
    pull.add_argument("--no-mtp", action="store_true",
                      help="leave out the MTP head's sidecar (mtp-*.gguf) published beside the model")
    pull.add_argument("--yes", "-y", action="store_true", help="download without asking, even when it does not fit")
    pull.add_argument("--n-ctx", type=int, default=8192,
                      help="positions per slot for the fit check (default 8192, at most the model's own)")
    pull.add_argument("--n-slots", type=int, default=4, help="slots for the fit check (default 4)")
    pull.add_argument("--host", metavar="SNAPSHOT.json",
                      help="check the fit on the host of this `appliance hostcheck --json` (default: this host)")
    _library_flags(pull)
    pull.set_defaults(func=pull_cmd)

    ls = sub.add_parser("models", help="list the models the appliance can serve",
                        description="List the embedded model, the library's models, and GGUF models "
                                    "found in the Hugging Face cache and in --models-dir directories.")
    ls.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                    help="also list the GGUF models under DIR (repeatable; APPLIANCE_MODELS_DIR's too)")
    ls.add_argument("--no-hf-cache", action="store_true", help="do not look in the Hugging Face cache")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    _library_flags(ls)
    ls.set_defaults(func=models_cmd)

    rm = sub.add_parser("rm", help="remove a pulled model from the library (its files too)",
                        description="Delete a model the library holds: its files, any partial "
                                    "download, and its record.")
    rm.add_argument("names", nargs="+", metavar="NAME")
    _library_flags(rm)
    rm.set_defaults(func=rm_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


# -- pull -------------------------------------------------------------------------------------

def _fit_check(args: argparse.Namespace, name: str, meta: dict, infos: list) -> bool:
    """Print whether the model fits the host (the fit planner on its header); True if it does."""
    from ..fit.command import BadInput, host_devices
    from ..fit.model import from_header
    from ..fit.planner import FitRequest, plan, suggest
    from ..fit.render import render

    m = from_header(name, meta, infos)
    try:
        devices = host_devices(args.host)
    except BadInput as e:
        _say(f"appliance pull: {e}")
        return True
    n_ctx = min(args.n_ctx, m.n_ctx_train) if m.n_ctx_train else args.n_ctx
    req = FitRequest(n_ctx=n_ctx, n_slots=args.n_slots)
    p = plan(m, req, devices)
    _say(render(m, p).rstrip())
    if not p.fits:
        for s in suggest(m, req, devices):
            _say(f"  would fit: {s}")
    return p.fits


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return True                         # a script asked for this pull: ask nothing
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


class _Stop(Exception):
    """A pull that ends before the library has the model: what to say, and the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True)
class _Pull:
    """What a pull fetches: the model's name in the library, its files on the hub, where they
    go, and its header (read from the hub before any download)."""

    name: str
    parts: list[RemoteFile]
    dests: list[Path]
    meta: dict
    infos: list
    mmproj: tuple[RemoteFile, Path] | None = None     # its vision projector, and where it goes
    mtp: tuple[RemoteFile, Path] | None = None        # its MTP head's sidecar, and where it goes

    @property
    def files(self) -> list[tuple[RemoteFile, Path]]:
        return [*zip(self.parts, self.dests), *(f for f in (self.mmproj, self.mtp) if f)]

    @property
    def total(self) -> int:
        return sum(f.size for f, _ in self.files)


def pull_cmd(args: argparse.Namespace) -> int:
    from .index import Library
    from .refs import RefError, parse_ref

    try:
        ref = parse_ref(args.ref, args.file, args.revision)
    except RefError as e:
        _say(f"appliance pull: {e}")
        return EXIT_USAGE
    lib = Library(args.library)
    try:
        pull = _resolve(args, ref, lib)
        if not _fit_check(args, pull.name, pull.meta, pull.infos) and not args.yes:
            if not _confirm("It does not fit this machine as planned. Download anyway?"):
                raise _Stop("not downloaded", EXIT_FAILED)
        _download(ref, lib, pull)
        entry = _add(ref, lib, pull)
    except _Stop as e:
        _say(e.message)
        return e.code
    _say(f"pulled {entry.name}: {human_bytes(entry.size)}, {entry.card.quant}, {entry.card.arch}, "
         f"context {entry.card.context()}" + ("" if entry.card.chat_template else ", no chat template")
         + (f", sees images ({entry.mmproj.name})" if entry.mmproj else "")
         + (f", drafts with its MTP head ({entry.mtp.name})" if entry.mtp else ""))
    print(entry.path)
    return EXIT_OK


def _resolve(args: argparse.Namespace, ref: Ref, lib: Library) -> _Pull:
    """The files `ref` names on the hub, the name they get in the library, and their header.
    _Stop when the name is another repository's, or the library has these files already."""
    from . import hub
    from .refs import RefError, choose

    try:
        listing = hub.list_files(ref.repo, ref.revision)
        parts = [listing[p] for p in choose(ref, list(listing))]
        mmproj, mtp = (None if f is None else (listing[f], lib.root / ref.repo / f)
                       for f in _sidecars(args, ref, list(listing), parts[0].path))
        name = args.name or lib.name_for(parts[0].path, ref.repo)
        have = lib.get(name)
        if have is not None and have.origin.get("repo") != ref.repo:
            raise _Stop(f"appliance pull: the library already has a model named {name} (from {have.source}); "
                        "give another with --name", EXIT_USAGE)
        dests = [lib.root / ref.repo / f.path for f in parts]
        files = [*zip(parts, dests), *(f for f in (mmproj, mtp) if f)]
        every = [f for f, _ in files]
        if have is not None and have.error is None and have.files == tuple(d for _, d in files) \
                and have.origin.get("sha256") == {f.path: f.sha256 for f in every}:
            raise _Stop(f"{name} is already in the library ({have.path})", EXIT_OK)
        _say(f"{ref.repo}: {', '.join(f.path for f in every)} ({human_bytes(sum(f.size for f in every))})")
        meta, infos = hub.remote_model(ref.repo, parts, ref.revision)
    except (RefError, hub.HubError) as e:
        raise _Stop(f"appliance pull: {e}", EXIT_FAILED) from None
    except ValueError as e:
        raise _Stop(f"appliance pull: {ref.repo}/{parts[0].path} is not a GGUF it can read: {e}",
                    EXIT_FAILED) from None
    return _Pull(name, parts, dests, meta, infos, mmproj, mtp)


def _sidecars(args: argparse.Namespace, ref: Ref, paths: list[str], model: str) -> tuple[str | None, str | None]:
    """The vision projector and the MTP head's sidecar that come with the model whose first file
    is `model` (None: none, or left out by --no-mmproj / --no-mtp). The head is the mtp-*.gguf
    llama-server's -hf would take (refs.sibling), the quant asked for, else the model's own, as
    the tag."""
    from .refs import MTP_SIDECAR, projector, quant_tag, sibling

    mm = None if args.no_mmproj else projector(paths, model)
    head = None if args.no_mtp else sibling(paths, model, MTP_SIDECAR, ref.quant or quant_tag(model))
    return mm, head


def _download(ref: Ref, lib: Library, pull: _Pull) -> None:
    """Each file into its place, resuming a .part left by an earlier pull; _Stop when the disk
    lacks room, the hub fails, or the user interrupts."""
    from . import hub

    lib.root.mkdir(parents=True, exist_ok=True)
    kept = sum(Path(f"{d}.part").stat().st_size for _, d in pull.files if Path(f"{d}.part").is_file())
    done = sum(d.stat().st_size for _, d in pull.files if d.is_file())
    free = shutil.disk_usage(lib.root).free
    if pull.total - kept - done > free:
        raise _Stop(f"appliance pull: {human_bytes(pull.total - kept - done)} to download, {human_bytes(free)} free "
                    f"under {lib.root}", EXIT_FAILED)
    try:
        for f, dest in pull.files:
            hub.download(ref.repo, f, dest, ref.revision)
    except hub.HubError as e:
        raise _Stop(f"appliance pull: {e}", EXIT_FAILED) from None
    except KeyboardInterrupt:
        raise _Stop("\ninterrupted: what was received is kept beside the final name as .part; "
                    "the same pull resumes it", EXIT_INTERRUPTED) from None


def _add(ref: Ref, lib: Library, pull: _Pull) -> Entry:
    """The downloaded files recorded in the library, with where they came from: its entry."""
    from . import hub

    origin = {"repo": ref.repo, "revision": ref.revision, "commit": hub.commit_of(ref.repo, ref.revision),
              "sha256": {f.path: f.sha256 for f, _ in pull.files}}
    try:
        return lib.add(pull.name, pull.dests, f"hf:{ref.repo}", origin, pull.mmproj[1] if pull.mmproj else None,
                       pull.mtp[1] if pull.mtp else None)
    except ValueError as e:
        raise _Stop(f"appliance pull: {e}", EXIT_FAILED) from None


# -- models, rm -------------------------------------------------------------------------------

def _embedded():
    from ..models import EMBEDDED_ALIAS, embedded_model_path
    from ..errors import ApplianceError
    from .index import Entry, read_card

    try:
        path = embedded_model_path()
    except ApplianceError:
        return []
    card, size, files, error = read_card(path)
    return [Entry(EMBEDDED_ALIAS, path, files, size, card, "embedded", error=error)]


def all_models(library: str | None, dirs: list[str], hf_cache: bool = True):
    from .index import Library

    import os

    lib = Library(library)
    # the directories `serve --models-dir` (APPLIANCE_MODELS_DIR) serves, as well as those given
    dirs = [*dirs, *(d for d in os.environ.get("APPLIANCE_MODELS_DIR", "").split(",") if d.strip())]
    return [*_embedded(), *lib.entries(), *lib.found([Path(d.strip()) for d in dirs], hf_cache=hf_cache)]


def models_cmd(args: argparse.Namespace) -> int:
    try:
        models = all_models(args.library, args.models_dir, not args.no_hf_cache)
    except OSError as e:
        _say(f"appliance models: {e}")
        return EXIT_FAILED
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return EXIT_OK
    rows = [("NAME", "SIZE", "QUANT", "ARCH", "PARAMS", "CONTEXT", "TEMPLATE", "IMAGES", "SOURCE")]
    for m in models:
        c = m.card
        rows.append((m.name, human_bytes(m.size), c.quant if c else "-", c.arch if c else "-",
                     human_params(c.n_params) if c else "-", c.context() if c else "-",
                     ("yes" if c.chat_template else "no") if c else "-", "yes" if m.mmproj else "-",
                     m.source + (f"  ({m.error})" if m.error else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return EXIT_OK


def rm_cmd(args: argparse.Namespace) -> int:
    from .index import Library

    lib = Library(args.library)
    status = EXIT_OK
    for name in args.names:
        try:
            entry = lib.remove(name)
        except KeyError:
            names = [e.name for e in lib.entries()]
            _say(f"appliance rm: {name} is not in the library "
                 f"({'it has ' + ', '.join(names) if names else 'it is empty'}); models found in the "
                 "Hugging Face cache or another directory are not the library's to remove")
            status = EXIT_FAILED
            continue
        except OSError as e:
            _say(f"appliance rm: {name}: {e}")
            status = EXIT_FAILED
            continue
        _say(f"removed {entry.name} ({human_bytes(entry.size)})")
    return status
