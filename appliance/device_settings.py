"""`--device-check off|warn|on`: whether a model starting with layers on a GPU is first checked
to compute what llama.cpp's CPU backend computes on the same file (engine/device_check.py). A
mixin of `EngineConfig` (config.py), so the flag is declared here beside what it means; nothing
here loads llama.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from .flags import opt

MODES = ("off", "warn", "on")


@dataclass(frozen=True)
class DeviceCheckSettings:
    """The device check's flag (a base class of EngineConfig: its fields are serve's flags)."""

    device_check: str = opt("on", "when a model starts with layers on a GPU, run a fixed text of about 100 tokens "
                            "through the GPU and through llama.cpp's CPU backend on the same file and compare the "
                            "logits (argmax agreement, KL, perplexity): on: refuse the start past the tolerance, "
                            "warn: serve and say so, off: no check. The verdict is remembered in the data "
                            "directory by model sha256, llama.cpp build, device and driver", switch=True)

    def check_device_check(self) -> None:
        if self.device_check not in MODES:
            raise ValueError(f"device_check must be off, warn or on, not {self.device_check!r}")

