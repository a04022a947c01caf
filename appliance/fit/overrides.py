"""llama-server's `-ot REGEX=DEVICE` items, checked: one parser for `serve --override-tensor`
(config) and `appliance fit -ot`. No gguf import: config reads it."""
from __future__ import annotations

import re


def parse_overrides(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(regex, device) pairs; ValueError for an item that is not REGEX=DEVICE or whose
    regular expression does not compile. Blank items are skipped."""
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        pattern, sep, device = item.rpartition("=")
        if not sep or not pattern or not device:
            raise ValueError(f"--override-tensor {item!r}: expected REGEX=DEVICE")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--override-tensor {item!r}: bad regular expression: {e}") from None
        out.append((pattern, device))
    return tuple(out)
