"""JSON nesting, bounded. Python's parser and encoder recurse once per level of arrays and
objects, so a document nested past the interpreter's recursion limit (about 1,000 levels, less
the caller's own stack) raises RecursionError wherever it is read or written. What a client
sends (`web/wire.py`) and what a model writes (`engine/tools.py`) are both read through `loads`
and held to MAX_DEPTH, well inside that limit, so that whatever is accepted can be encoded
again, rendered by a chat template's tojson and compiled by llguidance.
"""
from __future__ import annotations

import json
from typing import Any

# arrays and objects inside each other: far more than any real request or tool call (a JSON
# schema nests a few dozen), and few enough that nothing after parsing runs out of stack
MAX_DEPTH = 512


class TooDeep(ValueError):
    """A JSON document whose arrays and objects nest past MAX_DEPTH."""


def loads(text: str, **hooks: Any) -> Any:
    """`json.loads` (with `hooks`: parse_float, parse_constant, ...). Nesting past MAX_DEPTH
    is a TooDeep, whether the parser ran out of stack or the walk after it found it; invalid
    JSON stays a JSONDecodeError. Both are ValueErrors."""
    try:
        value = json.loads(text, **hooks)
    except RecursionError:
        raise TooDeep(f"nests deeper than {MAX_DEPTH} levels") from None
    if not within(value, MAX_DEPTH):
        raise TooDeep(f"nests deeper than {MAX_DEPTH} levels")
    return value


def within(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest at most `limit` deep in `value`, walked level by level
    (a recursive walk would meet the very limit this guards)."""
    level = [value] if isinstance(value, (dict, list)) else []    # the arrays and objects at one depth
    for _ in range(limit):
        if not level:
            return True
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
    return not level
