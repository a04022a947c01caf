"""llama-server's slot files: a slot's prompt state saved to, and restored from, a file a client
names in --slot-save-path (POST /slots/ID?action=save|restore).

A file is the disk tier's format (kvfile.py): a header with the state's fingerprint (model file,
context, KV type, engine build, prefill grid: `kvfile.fingerprint`) and its tokens, then the
checksummed state from the runner's `save`. A file of another fingerprint, or one that fails its
checks, is refused before the slot is touched: a state never loads into another model or KV
layout, and nothing is half-applied. A restored state is what the slot keeps (`PromptCache.load`),
so the next request whose prompt starts with its tokens reuses them as it reuses any slot's.

What a slot holds is what the prompt cache keeps of it: its last prompt's exactly reusable
positions (with --prompt-cache fast, the reply too), which is what a save writes and an erase
forgets.

File names are the client's; llama-server's rule (common's `fs_validate_filename`) decides
which are plain names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import InvalidRequest, NotSupported
from . import kvfile
from .prompt_cache import PromptCache

NO_SAVE_PATH = "This server does not support slots action. Start it with `--slot-save-path`"   # llama-server's
NAME_RULE = ("a plain file name in --slot-save-path: no path separators, no '..', no control characters or "
             ":*?\"<>|, no leading or trailing space, no trailing dot, at most 255 bytes")
# code points fs_validate_filename refuses besides controls and surrogates: look-alikes of '.',
# '/' and '\\', the replacement character and the byte order mark
REFUSED = frozenset({0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF, *map(ord, ':*?"<>|/\\')})


def valid_filename(name: str) -> bool:
    """Whether `name` is a plain file name by llama-server's rule (fs_validate_filename, without
    subdirectories): 1 to 255 bytes of UTF-8, no control characters (C0, DEL, C1), surrogates,
    path separators or characters Windows reserves, no leading or trailing space, no trailing
    dot, no '..' anywhere."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:      # a lone surrogate: no UTF-8 at all
        return False
    if not 0 < size <= 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or 0x7F <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or c in REFUSED:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)


@dataclass(frozen=True)
class Moved:
    """What a save or restore moved: the positions, the file's bytes, the milliseconds taken."""

    n_tokens: int
    n_bytes: int
    ms: float


class SlotFiles:
    """Slot states as files under `root` (None: --slot-save-path was not given)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def path(self, filename: str) -> Path:
        """The file a client's name stands for; NotSupported without a directory, InvalidRequest
        for a name that is not a plain one."""
        if self.root is None:
            raise NotSupported(NO_SAVE_PATH)
        if not isinstance(filename, str) or not valid_filename(filename):
            raise InvalidRequest(f"Invalid filename {filename!r}: it must be {NAME_RULE}", param="filename")
        return self.root / filename

    def save(self, cache: PromptCache, slot: int, filename: str) -> Moved:
        """Write an idle slot's kept state to `filename` (replacing a file of that name whole)."""
        path, t0 = self.path(filename), time.perf_counter()
        tokens, exact, blob = cache.export(slot)
        header = kvfile.header_line(cache.fingerprint, tokens, blob, exact)
        path.parent.mkdir(parents=True, exist_ok=True)
        # ':' is never in a client's name, so the temporary file is no client's file
        kvfile.write(path, header, blob, tmp=path.with_name(path.name + ":partial"))
        return Moved(len(tokens), path.stat().st_size, 1000.0 * (time.perf_counter() - t0))

    def restore(self, cache: PromptCache, slot: int, filename: str) -> Moved:
        """Put the state in `filename` into an idle slot, every check passed first."""
        path, t0 = self.path(filename), time.perf_counter()
        if not path.is_file():
            raise _unable(f"there is no file {filename!r} in --slot-save-path", "filename")
        header = kvfile.read_header(path)
        if header is None:
            raise _unable(f"{filename!r} is not a saved slot state (another format, or truncated)", "filename")
        mismatch = _differences(str(header.get("fingerprint")), cache.fingerprint)
        if mismatch:
            raise _unable(f"{filename!r} was saved under another model or KV layout; {mismatch}", "filename")
        tokens, exact = header.get("tokens"), header.get("exact")
        info = cache.runner.info
        if not (isinstance(tokens, list) and isinstance(exact, int)
                and all(isinstance(t, int) and t < info.n_vocab for t in tokens)):
            raise _unable(f"{filename!r} holds no valid token list", "filename")
        if len(tokens) > info.n_ctx:
            raise _unable(f"its {len(tokens)} positions do not fit the slot's context of {info.n_ctx}", "filename")
        try:
            blob = kvfile.read_blob(path)
        except (OSError, ValueError, KeyError) as e:
            raise _unable(f"{filename!r} fails its checks ({e})", "filename") from None
        try:
            cache.load(slot, tokens, exact, blob)
        except Exception as e:   # the runner refused it (a shared KV pool without room): the slot is empty
            raise _unable(f"the runner refused the state ({type(e).__name__}); the slot is now empty", None) from None
        return Moved(len(tokens), path.stat().st_size, 1000.0 * (time.perf_counter() - t0))


def _unable(why: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(f"Unable to restore slot: {why}", param=param)


def _differences(saved: str, here: str) -> str:
    """What differs between a file's fingerprint and this server's, said briefly ('' when
    nothing does)."""
    if saved == here:
        return ""
    a, b = saved.split("|"), here.split("|")
    ours = [x for x in b if x not in a][:3]
    theirs = [x for x in a if x not in b][:3]
    if not ours and not theirs:
        return "its fingerprint is not this server's"
    return f"the file has {', '.join(theirs) or '-'}; this server {', '.join(ours) or '-'}"
