"""The Hugging Face Hub, through `huggingface_hub`: the repository's file listing (sizes and the
LFS sha256 of each file), a GGUF's header read by byte ranges before anything is downloaded,
and downloads that resume and are checked.

`huggingface_hub` speaks the Hub's protocol here (endpoint and `HF_ENDPOINT`, token, URLs,
redirects, retries, its error types, its progress bar). Its `hf_hub_download` is not used for
the transfer itself: since 1.x it writes to a process-unique temporary file that is deleted on
any failure, so an interrupted 20 GB pull would start again from zero, and it checks the size
but not the sha256. `download` keeps `FILE.part` beside the final name, resumes it with a Range
request (`huggingface_hub.file_download.http_get`), checks the sha256 the Hub lists for the
file, and only then renames it into place.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..fit.gguf_header import TensorInfo, read_header_ranged


class HubError(Exception):
    """A failure the user can act on; the message says which and what to do."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None            # the LFS object id: the file's sha256 (None for a git file)


def _endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=_endpoint())


def explain(e: Exception, repo: str, what: str = "") -> HubError:
    """The Hub's error as one sentence that names the repository."""
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its terms on the Hub, then set HF_TOKEN (or `hf auth login`)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"{repo}: no such repository on the Hub (or it is private: set HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{repo}: no such revision")
    if isinstance(e, errors.EntryNotFoundError):
        return HubError(f"{repo}: no file {what}")
    if isinstance(e, errors.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return HubError(f"{repo}: the Hub answered {status} {what}".rstrip())
    return HubError(f"{repo}: cannot reach the Hub ({type(e).__name__}: {e})")


def _http_errors() -> tuple[type[Exception], ...]:
    from huggingface_hub import errors

    import httpx2  # huggingface_hub's HTTP client

    return (errors.HfHubHTTPError, httpx2.HTTPError, OSError)


def list_files(repo: str, revision: str = "main") -> dict[str, RemoteFile]:
    try:
        tree = _api().list_repo_tree(repo, revision=revision, recursive=True)
        return {f.path: RemoteFile(f.path, f.size, f.lfs.sha256 if f.lfs else None)
                for f in tree if hasattr(f, "size")}
    except _http_errors() as e:
        raise explain(e, repo) from None


def _url(repo: str, path: str, revision: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, path, revision=revision, endpoint=_endpoint())


def _headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers()


def read_remote_header(repo: str, f: RemoteFile, revision: str = "main"):
    """(metadata, tensor infos) of a GGUF on the Hub, read by byte ranges (a few MiB)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    url, headers = _url(repo, f.path, revision), _headers()

    def read(offset: int, length: int) -> bytes:
        r = get_session().get(url, headers={**headers, "Range": f"bytes={offset}-{offset + length - 1}"},
                              follow_redirects=True)
        hf_raise_for_status(r)
        data = r.content
        # a server that ignores Range sends the whole file from the start
        return data[offset:offset + length] if r.status_code == 200 else data

    try:
        return read_header_ranged(read, f.size)
    except _http_errors() as e:
        raise explain(e, repo, f.path) from None


def remote_model(repo: str, files: list[RemoteFile], revision: str = "main"):
    """(first part's metadata, every part's tensor infos) of a model on the Hub."""
    headers = [read_remote_header(repo, f, revision) for f in files]
    infos: list[TensorInfo] = [t for _, part in headers for t in part]
    return headers[0][0], infos


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def commit_of(repo: str, revision: str = "main") -> str | None:
    try:
        return _api().model_info(repo, revision=revision).sha
    except _http_errors():
        return None


def download(repo: str, f: RemoteFile, dest: Path, revision: str = "main") -> None:
    """`dest` complete and checked, or an exception and no file under that name. What was
    received stays in `dest.part` (also on Ctrl-C) and the next call resumes it."""
    from huggingface_hub.file_download import http_get

    if dest.is_file() and dest.stat().st_size == f.size and (f.sha256 is None or sha256_of(dest) == f.sha256):
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = Path(f"{dest}.part")
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    try:
        with open(part, "ab") as out:
            http_get(_url(repo, f.path, revision), out, resume_size=have, headers=_headers(),
                     expected_size=f.size, displayed_filename=f.path.rsplit("/", 1)[-1])
    except _http_errors() as e:
        kept = part.stat().st_size if part.is_file() else 0
        raise HubError(f"{explain(e, repo, f.path)}; {kept:,} of {f.size:,} bytes are kept in {part.name}: "
                       "run the same pull to resume") from None
    if f.sha256 is not None:
        got = sha256_of(part)
        if got != f.sha256:
            part.unlink()
            raise HubError(f"{repo}/{f.path}: the download's sha256 is {got}, the Hub lists {f.sha256}; "
                           "the file was removed, run the pull again")
    os.replace(part, dest)
