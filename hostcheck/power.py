"""Power: RAPL package energy (powercap), hwmon sensors (amdgpu SoC/board power), NVIDIA boards.

RAPL exposes a cumulative energy counter (`energy_uj`) that wraps at `max_energy_range_uj`;
power is its difference over time. hwmon and nvidia-smi report watts directly (hwmon in uW).
Caps: hwmon `power1_cap` against `power1_cap_default` within `power1_cap_min`..`power1_cap_max`,
NVIDIA `power.limit` against `power.default_limit` within `power.min_limit`..`power.max_limit`,
RAPL's long-term `constraint_0_power_limit_uw` up to `constraint_0_max_power_uw` (RAPL has no
default and no minimum). `bench --power-cap` sets them (appliance/bench/envelope.py).
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import gpu_nvidia
from .facts import Fs, Runner, Unavailable, run_command

POWERCAP = "/sys/class/powercap"
HWMON = "/sys/class/hwmon"
ROOT_ONLY = "root-only since Linux 5.10; run as root to read it"


@dataclass(frozen=True)
class PowerDomain:
    label: str                           # "package-0", "amdgpu", "NVIDIA GPU 0"
    kind: str                            # rapl, hwmon or nvidia
    path: str                            # sysfs directory, or "nvidia-smi"
    power_w: float | Unavailable         # now (RAPL: averaged over the probe's interval)
    cap_w: float | Unavailable           # the limit in force
    default_cap_w: float | Unavailable   # the part's default limit
    max_cap_w: float | Unavailable
    min_cap_w: float | Unavailable = Unavailable("not probed")   # with max_cap_w: the allowed range


@dataclass(frozen=True)
class PowerInfo:
    domains: tuple[PowerDomain, ...]
    not_found: tuple[str, ...] = ()      # why each source gave nothing


def energy_delta_uj(before: int, after: int, max_range_uj: int | None) -> int | None:
    """Energy used between two counter reads; the counter wraps at max_energy_range_uj."""
    if after >= before:
        return after - before
    if max_range_uj:
        return after + max_range_uj - before
    return None  # wrapped, and we cannot tell by how much


def rapl_zones(fs: Fs) -> list[str]:
    """Top-level RAPL zones (intel-rapl:0, not its subzones intel-rapl:0:0), AMD's included."""
    return [z for z in fs.glob(f"{POWERCAP}/*") if re.fullmatch(r"[\w-]*rapl[\w-]*:\d+",
                                                                 z.rsplit("/", 1)[-1])]


def hwmon_power_file(fs: Fs, hw: str) -> str | None:
    for name in ("power1_average", "power1_input"):
        if fs.exists(f"{hw}/{name}"):
            return f"{hw}/{name}"
    return None


def probe_power(root: str | Path = "/", run: Runner = run_command, interval_s: float = 0.25,
                sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> PowerInfo:
    fs = Fs(root)
    not_found: list[str] = []
    domains = _rapl(fs, interval_s, sleep, clock, not_found)
    domains += _hwmon(fs, not_found)
    domains += _nvidia(run, not_found)
    return PowerInfo(domains=tuple(domains), not_found=tuple(not_found))


def _rapl(fs: Fs, interval_s: float, sleep, clock, not_found: list[str]) -> list[PowerDomain]:
    zones = rapl_zones(fs)
    if not zones:
        not_found.append(f"RAPL: no {POWERCAP}" if not fs.exists(POWERCAP)
                         else f"RAPL: no rapl zones in {POWERCAP}")
        return []
    first = {z: (fs.read_int(f"{z}/energy_uj"), clock()) for z in zones}
    if any(isinstance(e, int) for e, _ in first.values()):
        sleep(interval_s)
    out = []
    for z in zones:
        power = _rapl_power(fs, z, *first[z], clock)
        name = fs.read(f"{z}/name")
        out.append(PowerDomain(
            label=name if isinstance(name, str) else z.rsplit("/", 1)[-1], kind="rapl", path=z,
            power_w=power, cap_w=_watts(fs, f"{z}/constraint_0_power_limit_uw"),
            default_cap_w=Unavailable("RAPL reports no default limit"),
            max_cap_w=_watts(fs, f"{z}/constraint_0_max_power_uw"),
            min_cap_w=Unavailable("RAPL reports no minimum limit")))
    return out


def _rapl_power(fs: Fs, z: str, e0: int | Unavailable, t0: float, clock) -> float | Unavailable:
    if isinstance(e0, Unavailable):
        return Unavailable(f"{z}/energy_uj is {ROOT_ONLY}") if "not readable" in e0.reason else e0
    e1, t1 = fs.read_int(f"{z}/energy_uj"), clock()
    if isinstance(e1, Unavailable):
        return e1
    wrap = fs.read_int(f"{z}/max_energy_range_uj")
    d = energy_delta_uj(e0, e1, wrap if isinstance(wrap, int) else None)
    if d is None or t1 <= t0:
        return Unavailable("the energy counter went back and max_energy_range_uj is unreadable")
    return d / 1e6 / (t1 - t0)


def _hwmon(fs: Fs, not_found: list[str]) -> list[PowerDomain]:
    out = []
    for hw in fs.glob(f"{HWMON}/hwmon*"):
        power_file = hwmon_power_file(fs, hw)
        if power_file is None:
            continue
        name = fs.read(f"{hw}/name")
        out.append(PowerDomain(
            label=name if isinstance(name, str) else hw.rsplit("/", 1)[-1], kind="hwmon", path=hw,
            power_w=_watts(fs, power_file), cap_w=_watts(fs, f"{hw}/power1_cap"),
            default_cap_w=_watts(fs, f"{hw}/power1_cap_default"),
            max_cap_w=_watts(fs, f"{hw}/power1_cap_max"),
            min_cap_w=_watts(fs, f"{hw}/power1_cap_min")))
    if not out:
        not_found.append(f"hwmon: no power sensors under {HWMON}" if fs.exists(HWMON)
                         else f"hwmon: no {HWMON}")
    return out


def _nvidia(run: Runner, not_found: list[str]) -> list[PowerDomain]:
    rows = gpu_nvidia.query(run, gpu_nvidia.POWER_FIELDS)
    if isinstance(rows, Unavailable):
        not_found.append(f"NVIDIA: {rows.reason}")
        return []
    return [PowerDomain(
        label=f"NVIDIA GPU {row.get('index')}", kind="nvidia", path="nvidia-smi",
        power_w=gpu_nvidia.number(row, "power.draw"), cap_w=gpu_nvidia.number(row, "power.limit"),
        default_cap_w=gpu_nvidia.number(row, "power.default_limit"),
        max_cap_w=gpu_nvidia.number(row, "power.max_limit"),
        min_cap_w=gpu_nvidia.number(row, "power.min_limit")) for row in rows]


def _watts(fs: Fs, path: str) -> float | Unavailable:
    uw = fs.read_int(path)
    return uw / 1e6 if isinstance(uw, int) else uw
