"""The sampler: synthetic streams reduce to the right medians, RAPL differences, clean stop."""
from __future__ import annotations

import sys
import threading
import types

import pytest

from hostcheck.readers import (AmdGpuClockReader, CpuClockReader, HwmonPowerReader, NvidiaReader,
                               RaplReader, default_readers)
from hostcheck.sampler import PhaseStats, Sampler

from .trees import FakeRunner, nvidia_runner


class Stream:
    """A reader that returns the next item of a fixed stream each tick ({} once exhausted)."""

    def __init__(self, name, items):
        self.name, self.items, self.times = name, list(items), []

    def read(self, now):
        self.times.append(now)
        return self.items.pop(0) if self.items else {}


class Clock:
    def __init__(self, t=0.0, step=1.0):
        self.t, self.step = t, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_medians_per_phase_from_synthetic_streams():
    # reads: 1 outside, 2 prefill entry, 3-4 inside, 5 prefill exit, 6 outside,
    # 7 decode entry, 8-10 inside, 11 decode exit. Entry reads are baselines; exits count.
    power = Stream("power", [{"power_w": w} for w in (1, 2, 80, 90, 85, 3, 4, 40, 30, 50, 35)])
    clocks = Stream("clocks", [{"cpu_mhz": c, "gpu_mhz": g} for c, g in
                               [(0, 0), (0, 0), (3000, 2300), (3100, 2400), (2900, 2350), (0, 0),
                                (0, 0), (4000, 2700), (4100, 2800), (3900, 2750), (4200, 2600)]])
    s = Sampler(power, clocks, clock=Clock())
    s.tick()                       # outside any phase: dropped
    with s.phase("prefill"):
        s.tick()
        s.tick()
    s.tick()                       # between phases: dropped
    with s.phase("decode"):
        s.tick()
        s.tick()
        s.tick()
    assert s.summary() == {
        "prefill": PhaseStats(median_power_w=85, median_cpu_mhz=3000,
                              median_gpu_mhz=2350, n_samples=3),
        "decode": PhaseStats(median_power_w=37.5, median_cpu_mhz=4050.0,
                             median_gpu_mhz=2725.0, n_samples=4),
    }


def test_power_adds_across_readers_and_survives_a_missed_tick():
    cpu = Stream("rapl", [{}, {"power_w": 20.0}, {}, {"power_w": 22.0}])       # misses ticks
    gpu = Stream("board", [{}, {"power_w": 300.0}, {"power_w": 310.0}, {"power_w": 290.0}])
    s = Sampler(cpu, gpu, clock=Clock())
    with s.phase("decode"):
        s.tick()
        s.tick()
    stats = s.summary()["decode"]
    assert stats.median_power_w == 21.0 + 300.0 and stats.median_cpu_mhz is None
    assert stats.n_samples == 3


def test_phase_reentry_accumulates_and_nesting_is_refused():
    s = Sampler(Stream("p", [{"power_w": float(i)} for i in range(10)]), clock=Clock())
    for _ in range(2):
        with s.phase("decode"):
            pass
    assert s.summary()["decode"].n_samples == 2  # one exit tick per entry
    with s.phase("prefill"):
        with pytest.raises(RuntimeError):
            with s.phase("decode"):
                pass
    assert list(s.summary()) == ["decode", "prefill"]


def test_rapl_power_from_energy_differences_with_wraparound(apu):
    energy = apu / "sys/class/powercap/intel-rapl:0/energy_uj"
    wrap = 65532610987
    readings = iter([1_000_000, 51_000_000, 101_000_000, wrap - 9_000_000, 41_000_000])
    reader = RaplReader(apu)
    assert reader.zones == ["/sys/class/powercap/intel-rapl:0"]  # the package, not its core

    class Rapl:
        name = "rapl"

        def read(self, now):
            energy.write_text(str(next(readings)))
            return reader.read(now)

    s = Sampler(Rapl(), clock=Clock(step=0.5))
    with s.phase("prefill"):   # baseline at entry, then three differences over 0.5 s each
        s.tick()
        s.tick()
        s.tick()
    # 50 J, 50 J, (65532.6 - 9 - 101) J, and across the wrap 9 + 41 = 50 J; each over 0.5 s
    assert s.summary()["prefill"].median_power_w == 100.0
    assert s.summary()["prefill"].n_samples == 4


def test_thread_samples_and_stops_cleanly():
    ticked = threading.Event()

    class Flaky:
        name, n = "flaky", 0

        def read(self, now):
            self.n += 1
            if self.n == 2:
                raise OSError("a sensor went away")  # must not kill the thread
            if self.n >= 4:
                ticked.set()
            return {"cpu_mhz": 1000.0}

    s = Sampler(Flaky(), interval_s=0.001)
    s.stop()                            # stop before start: nothing to do
    with s.phase("decode"):
        s.start()
        thread = s._thread
        assert s.start()._thread is thread  # idempotent: one thread
        assert ticked.wait(5.0)
    s.stop()
    s.stop()
    assert not thread.is_alive() and not s.running
    stats = s.summary()["decode"]
    assert stats.n_samples >= 3 and stats.median_cpu_mhz == 1000.0
    n = len(s.samples)
    with s:                             # a context manager: start and stop again
        assert s.running
    assert not s.running and len(s.samples) == n  # ticks outside a phase are dropped


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        Sampler(interval_s=0)


def test_default_readers_on_the_apu_use_soc_power_not_rapl(apu):
    readers = default_readers(apu, FakeRunner())
    assert [type(r) for r in readers] == [CpuClockReader, AmdGpuClockReader, HwmonPowerReader]
    values = [r.read(1.0) for r in readers]
    assert values == [{"cpu_mhz": 2950.0}, {"gpu_mhz": 2229.0}, {"power_w": 69.0}]


def test_default_readers_on_the_desktop_add_the_board_to_the_package(desktop):
    readers = default_readers(desktop, nvidia_runner())
    assert [type(r) for r in readers] == [CpuClockReader, NvidiaReader, RaplReader]
    assert readers[1].read(1.0) == {"power_w": 301.5, "gpu_mhz": 2715.0}


def test_sampler_for_the_vm_reads_only_the_cpu_clock(vm):
    s = Sampler.for_host(vm, FakeRunner())
    assert [type(r) for r in s.readers] == [CpuClockReader]
    with s.phase("prefill"):
        pass
    assert s.summary()["prefill"] == PhaseStats(None, 2596.132, None, 1)


def test_nvidia_reader_prefers_nvml(monkeypatch):
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPowerUsage=lambda h: [250_000, 260_000][h],   # milliwatts
        nvmlDeviceGetClockInfo=lambda h, kind: [2500, 2600][h])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    run = FakeRunner()
    assert NvidiaReader(run).read(0.0) == {"power_w": 510.0, "gpu_mhz": 2550.0}
    assert run.calls == []  # nvidia-smi never ran
