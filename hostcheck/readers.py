"""What the sampler reads each tick: power and clock readers, and the default set for a host.

A reader's `read(now)` returns the metrics it could read this tick ({"power_w": 84.2}), or {}
when it could not; it never raises. Metrics: `power_w` (summed over readers: CPU package plus
a discrete GPU's board), `cpu_mhz` and `gpu_mhz` (median over readers), and from a counter
(RAPL) `energy_j` with `energy_from`: the joules since its previous read and when that was
(energy.py integrates a phase from them).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Protocol

from . import gpu_nvidia
from .cpu import read_cpu_mhz
from .energy import ENERGY, ENERGY_FROM, POWER
from .facts import Fs, Runner, Unavailable, run_command
from .gpu_amd import read_amd_sclk_mhz
from .power import energy_delta_uj, hwmon_power_file, probe_power, rapl_zones

CPU_MHZ, GPU_MHZ = "cpu_mhz", "gpu_mhz"
__all__ = ["CPU_MHZ", "ENERGY", "ENERGY_FROM", "GPU_MHZ", "POWER"]


class Reader(Protocol):
    name: str

    def read(self, now: float) -> dict[str, float]: ...


class RaplReader:
    """Package power from RAPL energy counters: the first read only sets the baseline."""

    gives_power = True   # the sampler integrates its energy in every phase, read or not

    def __init__(self, root: str | Path = "/", zones: list[str] | None = None):
        self.fs = Fs(root)
        self.zones = zones if zones is not None else [
            z for z in rapl_zones(self.fs) if str(self.fs.read(f"{z}/name")).startswith("package")]
        self.name = "rapl:" + ",".join(z.rsplit("/", 1)[-1] for z in self.zones)
        self._last: tuple[float, list[int]] | None = None

    def readable(self) -> bool:
        return bool(self.zones) and all(isinstance(self.fs.read_int(f"{z}/energy_uj"), int)
                                        for z in self.zones)

    def read(self, now: float) -> dict[str, float]:
        energies = [self.fs.read_int(f"{z}/energy_uj") for z in self.zones]
        if not energies or not all(isinstance(e, int) for e in energies):
            return {}
        last, self._last = self._last, (now, energies)  # type: ignore[assignment]
        if last is None or now <= last[0]:
            return {}
        total = 0
        for z, before, after in zip(self.zones, last[1], energies):
            wrap = self.fs.read_int(f"{z}/max_energy_range_uj")
            d = energy_delta_uj(before, after, wrap if isinstance(wrap, int) else None)
            if d is None:
                return {}
            total += d
        return {POWER: total / 1e6 / (now - last[0]), ENERGY: total / 1e6, ENERGY_FROM: last[0]}


class HwmonPowerReader:
    """A hwmon power sensor (uW): amdgpu's SoC power on an APU, its board power on a card."""

    gives_power = True

    def __init__(self, root: str | Path, hwmon_dir: str):
        self.fs, self.file = Fs(root), hwmon_power_file(Fs(root), hwmon_dir)
        self.name = f"hwmon:{hwmon_dir}"

    def read(self, now: float) -> dict[str, float]:
        uw = self.fs.read_int(self.file) if self.file else None
        return {POWER: uw / 1e6} if isinstance(uw, int) else {}


class CpuClockReader:
    name = "cpu clock"

    def __init__(self, root: str | Path = "/"):
        self.root = root

    def read(self, now: float) -> dict[str, float]:
        mhz = read_cpu_mhz(self.root)
        return {CPU_MHZ: mhz} if isinstance(mhz, float) else {}


class AmdGpuClockReader:
    def __init__(self, root: str | Path, device_dir: str):
        self.fs, self.dev, self.name = Fs(root), device_dir, f"sclk:{device_dir}"

    def read(self, now: float) -> dict[str, float]:
        mhz = read_amd_sclk_mhz(self.fs, self.dev)
        return {GPU_MHZ: mhz} if isinstance(mhz, float) else {}


class NvidiaReader:
    """Board power (summed) and SM clock (median) of every NVIDIA GPU: NVML if importable (with
    its energy counters where the GPU has them), else one `nvidia-smi` query per tick (tens of
    milliseconds; keep interval_s >= 0.1), whose watts the sampler integrates."""

    name, gives_power = "nvidia", True

    def __init__(self, run: Runner = run_command, use_nvml: bool = True):
        self.run, self._nvml, self._handles = run, None, []
        self._last_energy: tuple[float, list[int]] | None = None
        if use_nvml:
            try:
                import pynvml  # optional: the nvidia-ml-py package

                pynvml.nvmlInit()
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                                 for i in range(pynvml.nvmlDeviceGetCount())]
                self._nvml = pynvml
            except Exception:  # not installed, or no driver: fall back to nvidia-smi
                self._nvml, self._handles = None, []

    def read(self, now: float) -> dict[str, float]:
        if self._nvml is not None:
            return self._read_nvml(now)
        rows = gpu_nvidia.query(self.run, gpu_nvidia.SAMPLE_FIELDS)
        if isinstance(rows, Unavailable):
            return {}
        watts = [gpu_nvidia.number(r, "power.draw") for r in rows]
        clocks = [gpu_nvidia.number(r, "clocks.sm") for r in rows]
        return _combine([w for w in watts if isinstance(w, float)],
                        [c for c in clocks if isinstance(c, float)])

    def _read_nvml(self, now: float) -> dict[str, float]:
        nv = self._nvml
        try:
            watts = [nv.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in self._handles]  # mW
            clocks = [float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)) for h in self._handles]
        except Exception:  # a GPU fell off the bus mid-run: skip this tick
            return {}
        return {**_combine(watts, clocks), **self._energy(now)}

    def _energy(self, now: float) -> dict[str, float]:
        """Joules since the previous read from NVML's energy counters (mJ since the driver
        loaded; Volta and later), summed over the GPUs: exact where the power samples are not.
        {} where a GPU has no counter, and on the first read (the baseline)."""
        try:
            mj = [int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]
        except Exception:  # not supported on this GPU: the sampler integrates power instead
            self._last_energy = None
            return {}
        last, self._last_energy = self._last_energy, (now, mj)
        if last is None or now <= last[0] or any(b < a for a, b in zip(last[1], mj)):
            return {}
        return {ENERGY: sum(b - a for a, b in zip(last[1], mj)) / 1000.0, ENERGY_FROM: last[0]}


def _combine(watts: list[float], clocks: list[float]) -> dict[str, float]:
    out = {}
    if watts:
        out[POWER] = sum(watts)
    if clocks:
        out[GPU_MHZ] = statistics.median(clocks)
    return out


def default_readers(root: str | Path = "/", run: Runner = run_command) -> list[Reader]:
    """The readers this host supports, without counting the same watts twice.

    On an APU amdgpu's hwmon already measures the whole SoC, so RAPL's package is left out;
    with a discrete GPU its board power is added to the CPU package's.
    """
    from .gpu import probe_gpus  # here, not at the top: the GPU probe is only needed once

    fs = Fs(root)
    report = probe_gpus(root, run)
    readers: list[Reader] = [CpuClockReader(root)]
    soc_measured = False  # an APU's hwmon power already covers the CPU cores
    for g in report.gpus:
        if g.vendor == "AMD" and g.source.startswith("/sys/class/drm/"):
            dev = f"{g.source}/device"
            readers.append(AmdGpuClockReader(root, dev))
            for hw in fs.glob(f"{dev}/hwmon/hwmon*"):
                if hwmon_power_file(fs, hw):
                    readers.append(HwmonPowerReader(root, hw))
                    soc_measured = soc_measured or g.unified is True
    if any(g.vendor == "NVIDIA" and g.source == "nvidia-smi" for g in report.gpus):
        readers.append(NvidiaReader(run))
    rapl = RaplReader(root)
    if not soc_measured and rapl.readable():
        readers.append(rapl)
    return readers


def energy_unavailable(readers: list[Reader], root: str | Path = "/", run: Runner = run_command) -> str:
    """Why no energy can be measured on this host: each power source's reason ("" when a
    reader of power is among `readers`)."""
    if any(getattr(r, "gives_power", False) for r in readers):
        return ""
    info = probe_power(root, run, interval_s=0.0, sleep=lambda s: None)
    reasons = list(info.not_found) + [f"{d.label}: {d.power_w.reason}" for d in info.domains
                                      if isinstance(d.power_w, Unavailable)]
    return "no power reader: " + ("; ".join(reasons) or "none of this host's power sensors is readable")
