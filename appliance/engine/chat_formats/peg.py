"""The steps llama.cpp's PEG chat parsers (common/peg-parser.cpp) are made of, for the families
that read a reply as those parsers do. llama.cpp parses leniently (its partial and whole parses
alike): a literal the text ends inside is "need more input" (MORE), not a failure (FAIL), and
`until` stops before a part of its delimiter the text ends in. A step returns where what it
matched ends, MORE or FAIL.
"""
from __future__ import annotations

import re

MORE = -1          # the text ends inside what is being matched
FAIL = -2
SPACE = re.compile(r"[ \t\n\r\f\v]*")
TYPE = re.compile(r"[A-Za-z0-9_-]*")


def lit(text: str, pos: int, s: str) -> int:
    """`s` at `pos`: where it ends, MORE if the text ends inside it, else FAIL."""
    if text.startswith(s, pos):
        return pos + len(s)
    return MORE if len(text) - pos < len(s) and s.startswith(text[pos:]) else FAIL


def until(text: str, pos: int, delim: str) -> tuple[int, bool]:
    """(where the text before `delim` ends, whether it ended): llama.cpp's `until`, which also
    stops before a part of `delim` the text ends in."""
    at = text.find(delim, pos)
    if at >= 0:
        return at, True
    for n in range(min(len(delim) - 1, len(text) - pos), 0, -1):
        if text.endswith(delim[:n]):
            return len(text) - n, True
    return len(text), False


def until_any(text: str, pos: int, delims: tuple[str, ...]) -> tuple[int, bool]:
    """llama.cpp's until_one_of: the earliest delimiter, or a part of one the text ends in."""
    best = (len(text), False)
    for d in delims:
        end, ended = until(text, pos, d)
        if ended and end < best[0]:
            best = (end, True)
    return best
