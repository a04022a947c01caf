"""The file of one saved prompt state on disk, and its checks.

    <key>.kv = MAGIC, a JSON header line (fingerprint, the state's tokens, blob length, sha256,
               how many leading positions are exact), the blob

A file is written to `<key>.tmp`, fsynced and renamed, so a crash leaves either the whole file
or a temporary one that the next start deletes; a file that is truncated, has another magic or
fails its checksum is never loaded. The blob is written as it is: joining it to its header
first would copy the whole state (a few hundred MB for a long context).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

MAGIC = b"APPLIANCE-KV2\n"   # KV1 files (keyed by grid blocks) are deleted at start as unreadable


def fingerprint(kv_fingerprint: str, chunk: int, min_chunk: int) -> str:
    """What a saved state's validity depends on: what the runner says its KV depends on (model
    file, context, KV type, engine build, batch shapes: `kv_fingerprint()`), this appliance's
    version and the prefill grid (its chunk, and whether any chunk computes as the grid's)."""
    from ... import __version__

    return "|".join([kv_fingerprint, f"appliance={__version__}", f"chunk={chunk}", f"min_chunk={min_chunk}"])


def header_line(fingerprint: str, tokens: Sequence[int], blob: bytes, exact: int | None = None) -> bytes:
    """The JSON header, without its newline; its checksum reads the whole blob. `exact`: how
    many leading positions are exact to reuse (all of them unless --prompt-cache fast)."""
    return _json(fingerprint, tokens, len(blob), hashlib.sha256(blob).hexdigest(), exact)


def file_size(fingerprint: str, tokens: Sequence[int], blob_len: int, exact: int | None = None) -> int:
    """A state's file size, known before its checksum (a sha256 is always 64 hex digits)."""
    return len(MAGIC) + len(_json(fingerprint, tokens, blob_len, "0" * 64, exact)) + 1 + blob_len


def _json(fingerprint: str, tokens: Sequence[int], blob_len: int, sha256: str, exact: int | None) -> bytes:
    return json.dumps({"fingerprint": fingerprint, "tokens": list(tokens), "blob_len": blob_len, "sha256": sha256,
                       "exact": len(tokens) if exact is None else exact}, separators=(",", ":")).encode()


def write(path: Path, header: bytes, blob: bytes, tmp: Path | None = None) -> None:
    """Write to a temporary name (`tmp`, else `<key>.tmp`), fsync, rename; on any failure no
    file is left behind."""
    tmp = tmp or path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + header + b"\n")
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_header(path: Path) -> dict | None:
    """The header of a complete file (its length matches), or None."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            line = f.readline()
            header = json.loads(line)
            f.seek(0, 2)
            if f.tell() != len(MAGIC) + len(line) + header["blob_len"]:
                return None  # truncated
            return header
    except (OSError, ValueError, KeyError):
        return None


def read_blob(path: Path) -> bytes:
    """The file's blob, checked against its header; OSError, ValueError or KeyError if not."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("bad magic")
        header = json.loads(f.readline())
        blob = f.read()
    if len(blob) != header["blob_len"] or hashlib.sha256(blob).hexdigest() != header["sha256"]:
        raise ValueError("checksum mismatch")
    return blob
