"""LoRA adapters as llama-server takes them: `--lora FNAME` (several, or comma-separated, each at
scale 1), `--lora-scaled FNAME:SCALE` (several, or comma-separated) and
`--lora-init-without-apply` (every adapter loaded at scale 0 until a client sets one). The
settings are a mixin of `EngineConfig` (config.py), declared and parsed here, so the flags
stay one concept in one module; nothing here loads llama.cpp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .flags import opt


@dataclass(frozen=True)
class LoraFile:
    """One adapter as the flags give it: its file and the scale it starts at."""

    path: str
    scale: float


def _files(value: str | None, what: str, scaled: bool) -> list[LoraFile]:
    out = []
    for item in (value or "").split(",") if value else []:
        path, scale = item.strip(), "1"
        if scaled:   # FNAME:SCALE, the scale after the last colon (llama-server's form)
            path, sep, scale = item.strip().rpartition(":")
            if not sep:
                raise ValueError(f"{what} {item!r}: give FNAME:SCALE")
        try:
            number = float(scale)
        except ValueError:
            raise ValueError(f"{what} {item!r}: the scale {scale!r} is not a number") from None
        if not path or not math.isfinite(number):
            raise ValueError(f"{what} {item!r}: give a file and a finite scale")
        out.append(LoraFile(path, number))
    return out


@dataclass(frozen=True)
class AdapterSettings:
    """The LoRA flags (a base class of EngineConfig: its fields are serve's flags)."""

    lora: str | None = opt(None, "LoRA adapter GGUF to apply at scale 1 (llama-server's --lora): give the flag "
                           "again, or comma-separated files, for several; ids count from 0 in that order, "
                           "--lora's before --lora-scaled's", repeat=True)
    lora_scaled: str | None = opt(None, "LoRA adapter with its scale, FNAME:SCALE (llama-server's --lora-scaled): "
                                  "again, or comma-separated, for several", repeat=True)
    lora_init_without_apply: bool = opt(False, "load the LoRA adapters at scale 0, applied once a client sets "
                                        "their scales (POST /lora-adapters, or a request's lora)")

    def lora_files(self) -> tuple[LoraFile, ...]:
        """The adapters in id order, each at its start scale (0 with --lora-init-without-apply)."""
        files = _files(self.lora, "--lora", False) + _files(self.lora_scaled, "--lora-scaled", True)
        if self.lora_init_without_apply:
            files = [LoraFile(f.path, 0.0) for f in files]
        return tuple(files)

    def check_adapters(self) -> None:
        """ValueError for a malformed flag, or adapters on the torch runner, which has no LoRA."""
        if self.lora_files() and getattr(self, "engine", None) == "torch":
            raise ValueError("--lora needs the llama.cpp engine (--engine llamacpp): the torch runner "
                             "does not apply LoRA adapters")
