"""A GGUF's header, read fast: its metadata and tensor infos, with no tensor data.

`gguf.GGUFReader` builds a numpy view per array element, which takes 5 s for the 98,000 strings
of the embedded model's tokenizer on this CPU; the planner needs none of them. This reader walks
the same format (GGUF v2/v3: magic, version, tensor count, metadata count, the key/value pairs,
then one info per tensor) and keeps scalars and arrays, but for an array longer than
MAX_KEPT_ARRAY (a tokenizer's) only its length. The tests compare what it reads with
GGUFReader's.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_KEPT_ARRAY = 4096          # longer arrays are kept as their length only


@dataclass(frozen=True)
class StringArray:
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]       # ggml order, innermost first
    nbytes: int
    offset: int = 0              # where its data starts in the file (the data section aligned)


class PastEnd(ValueError):
    """The header runs past the end of the bytes given: a truncated file, or a prefix of one."""


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        if self.pos + struct.calcsize(fmt) > len(self.buf):
            raise PastEnd("the header runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.buf) - self.pos:
            raise PastEnd("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, count = self.take("<I"), self.take("<Q")
        if itype == _STRING:
            if count <= MAX_KEPT_ARRAY:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                n = self.take("<Q")     # (not `pos += take()`: that reads pos before take moves it)
                self.pos += n
            if self.pos > len(self.buf):
                raise PastEnd("a string array runs past the end of the file")
            return StringArray(count)
        if itype not in _SCALARS:
            raise ValueError(f"unsupported GGUF array of type {itype}")
        size = struct.calcsize(_SCALARS[itype])
        if self.pos + size * count > len(self.buf):
            raise PastEnd("an array runs past the end of the file")
        if count > MAX_KEPT_ARRAY:
            self.pos += size * count
            return StringArray(count)
        values = list(struct.unpack_from("<" + _SCALARS[itype][1] * count, self.buf, self.pos))
        self.pos += size * count
        return values


def nbytes(ggml_type: str, n_elements: int) -> int:
    """Bytes of `n_elements` values of a ggml type (whole blocks: a row is a multiple of one)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return n_elements // block * size


def read_header(path: str | Path) -> tuple[dict[str, object], list[TensorInfo]]:
    """(metadata, tensor infos). Raises ValueError for a file that is not a GGUF it can read."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ValueError("the file is empty") from None
    try:
        return parse(buf)
    finally:
        buf.close()


def parse(buf) -> tuple[dict[str, object], list[TensorInfo]]:
    """(metadata, tensor infos) of the GGUF whose first bytes are `buf`. Raises PastEnd when the
    header goes on past `buf`, ValueError when it is not a GGUF header it can read."""
    try:
        return _parse(buf)
    except (struct.error, KeyError, OverflowError) as e:
        raise ValueError(f"a truncated or malformed GGUF header ({e})") from None
    except PastEnd as e:
        raise PastEnd(f"a truncated GGUF header ({e})") from None


def read_header_ranged(read: Callable[[int, int], bytes], size: int, first: int = 1 << 21,
                       limit: int = 1 << 28) -> tuple[dict[str, object], list[TensorInfo]]:
    """A header read through `read(offset, length)` (a remote file's byte ranges): the first
    `first` bytes, then twice as many at a time until the header ends within them (a 150,000-
    token vocabulary takes a few MiB). `size` is the file's; past `limit` it gives up."""
    buf = read(0, min(first, size))
    while True:
        try:
            return parse(buf)
        except PastEnd:
            if len(buf) >= size or len(buf) >= limit:
                raise
            buf += read(len(buf), min(len(buf), size - len(buf)))


def _parse(buf) -> tuple[dict[str, object], list[TensorInfo]]:
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start of the file")
    c = _Cursor(buf)
    c.pos = 4
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not one it reads (2, 3)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        shape = tuple(c.take("<Q") for _ in range(c.take("<I")))
        kind = GGMLQuantizationType(c.take("<I")).name
        infos.append((name, kind, shape, c.take("<Q")))  # the offset within the data section
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-c.pos // align) * align
    return meta, [TensorInfo(name, kind, shape, nbytes(kind, math.prod(shape)), start + off)
                  for name, kind, shape, off in infos]
