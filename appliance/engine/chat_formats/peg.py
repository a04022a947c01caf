"""The steps llama.cpp's PEG chat parsers (common/peg-parser.cpp) are made of, for the families
that read a reply as those parsers do. llama.cpp parses leniently (its partial and whole parses
alike): a literal the text ends inside is "need more input" (MORE), not a failure (FAIL), and
`until` stops before a part of its delimiter the text ends in. A step returns where what it
matched ends, MORE or FAIL.
"""
from __future__ import annotations

import json
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


# --- the same steps as grammar rules (Lark, llguidance) -----------------------------------------

def until_rule(name: str, marker: str | tuple[str, ...], not_after: str = "") -> str:
    """Lark rules for `name`: any text, then `marker` (llama.cpp's `until` and the delimiter; or
    the first of several, its `until_one_of`), ending at the marker's first occurrence, whether
    the model spells the marker out or writes it as the special token of its vocabulary
    (special_tokens.py names the quoted literal as that token). A `[stop=...]` lexeme cannot do
    both: llguidance refuses a special token as a stop value ("special tokens cannot be used in
    terminals"), and a quoted stop text matches the spelled bytes only. So: a lazy lexeme that
    ends with the spelled marker, or greedy text (no text matches a special token, so it ends
    there) and the marker as a literal.

    `not_after`: a text the part may not start with, where a literal that starts with it may
    come instead (a reasoning block's opening tag): the lexer takes the longest lexeme, so text
    that could take the tag would, and the rule that starts with it would never be taken."""
    markers = (marker,) if isinstance(marker, str) else marker
    ends = "|".join(regex_text(m) for m in markers)
    unless = f" & ~/{regex_text(not_after)}(?s:.*)/" if not_after else ""
    text = f"{name.upper()}_TEXT"
    return (f"{name}: {name}_spelled | {text} ({' | '.join(json.dumps(m, ensure_ascii=False) for m in markers)})\n"
            f"{name}_spelled[lazy]: /(?s:.*)({ends})/{unless}\n"
            f"{text}: /(?s:.*)/{unless}\n")


def regex_text(s: str) -> str:
    """`s` as a Lark /regex/ that matches it literally."""
    return "".join("\\" + c if c in _META else c for c in s)


_META = set("\\.^$|?*+()[]{}/-#&~")
