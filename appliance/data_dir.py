"""Where the appliance keeps its files: the XDG data directory. Moved out of config.py, which
re-exports it; like config.py it reads the environment only when it is not handed one."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """$XDG_DATA_HOME/appliance, else ~/.local/share/appliance. The XDG spec says a relative
    XDG_DATA_HOME is invalid and must be ignored."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "appliance"
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".local" / "share" / "appliance"
