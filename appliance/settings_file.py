"""The library directory's `settings.toml`, read once for its two readers: the models' tables
(library/catalog.py) and the MCP servers' `[mcp]` table (mcp/settings.py)."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

SETTINGS = "settings.toml"


def read(root: Path) -> dict[str, Any]:
    """`root`/settings.toml parsed (empty when there is none). ValueError names the file."""
    path = root / SETTINGS
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
