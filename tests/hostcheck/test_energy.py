"""Energy per phase: RAPL counters summed wrap-safe over each span, hwmon/NVIDIA watts integrated
by the trapezoid rule, a reader that vanishes making the span unavailable, never a partial sum."""
from __future__ import annotations

import pytest

from hostcheck.energy import ENERGY, ENERGY_FROM, PhaseEnergy, Reading, reader_joules
from hostcheck.facts import Unavailable
from hostcheck.readers import HwmonPowerReader, NvidiaReader, RaplReader
from hostcheck.sampler import Sampler

from .test_sampler import Clock
from .trees import APU_HWMON, nvidia_runner


def counter(root, readings, zone="intel-rapl:0"):
    """A RAPL reader whose counter takes the next of `readings` at each read (None: unreadable)."""
    path = root / f"sys/class/powercap/{zone}/energy_uj"
    reader, values = RaplReader(root), iter(readings)

    class Counter:
        name, gives_power = "rapl", True

        def read(self, now):
            v = next(values)
            if v is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(f"{v}\n")
            return reader.read(now)
    return Counter()


def test_rapl_counter_wrapping_mid_phase_sums_each_difference(apu):
    wrap = 65532610987
    # entry 1 J; then +50 J, a wrap (+9 J to the top, then 41 J past zero), +50 J at exit
    s = Sampler(counter(apu, [1_000_000, 51_000_000, wrap - 9_000_000, 41_000_000, 91_000_000]),
                clock=Clock(step=0.5))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
        s.tick()
    e = s.span_energy(span)
    assert e.seconds == 2.0
    assert e.joules == pytest.approx(50 + (wrap - 9_000_000 - 51_000_000) / 1e6 + 50 + 50)
    assert e.by_reader == {"rapl": e.joules}
    assert s.energy()["decode"].joules == e.joules


def test_each_span_has_its_own_joules_and_a_phase_adds_them(apu):
    s = Sampler(counter(apu, [0, 10_000_000, 10_000_000, 40_000_000]), clock=Clock(step=0.5))
    with s.phase("prefill") as a:
        pass
    with s.phase("prefill") as b:
        pass
    assert (s.span_energy(a).joules, s.span_energy(b).joules) == (10.0, 30.0)
    total = s.energy()["prefill"]
    assert (total.joules, total.seconds, total.watts) == (40.0, 1.0, 40.0)


def test_a_counter_that_vanishes_mid_phase_and_stays_gone_is_unavailable(apu):
    s = Sampler(counter(apu, [0, 10_000_000, None, None]), clock=Clock(step=0.5))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
    e = s.span_energy(span)
    assert isinstance(e.joules, Unavailable) and "rapl" in e.joules.reason
    assert isinstance(e.by_reader["rapl"], Unavailable)


def test_a_counter_that_comes_back_inside_the_phase_still_tiles_it(apu):
    # unreadable for one tick: the next difference spans the gap, all inside the phase
    s = Sampler(counter(apu, [0, 10_000_000, None, 30_000_000, 35_000_000]), clock=Clock(step=0.5))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
        s.tick()
    assert s.span_energy(span).joules == 35.0


def test_a_counter_gone_at_the_phase_start_is_not_counted_from_before_it(apu):
    # the entry read fails: the first difference would start before the phase
    s = Sampler(counter(apu, [0, None, 20_000_000, 30_000_000]), clock=Clock(step=0.5))
    s.tick()
    with s.phase("decode") as span:
        s.tick()
    assert isinstance(s.span_energy(span).joules, Unavailable)


def test_a_wrap_without_a_known_range_is_unavailable(apu):
    (apu / "sys/class/powercap/intel-rapl:0/max_energy_range_uj").unlink()
    s = Sampler(counter(apu, [50_000_000, 60_000_000, 1_000_000, 2_000_000]), clock=Clock(step=0.5))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
    assert "max_energy_range_uj" in s.span_energy(span).joules.reason


def test_hwmon_watts_integrated_by_the_trapezoid_rule(apu):
    power = apu / APU_HWMON.lstrip("/") / "power1_input"
    watts = iter([60, 80, 100, 100])
    reader = HwmonPowerReader(apu, APU_HWMON)

    class Sensor:
        name, gives_power = "hwmon", True

        def read(self, now):
            power.write_text(f"{next(watts) * 1_000_000}\n")
            return reader.read(now)

    s = Sampler(Sensor(), clock=Clock(step=1.0))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
    # (60+80)/2 + (80+100)/2 + (100+100)/2 over three one-second intervals
    assert s.span_energy(span).joules == 70 + 90 + 100
    assert s.summary()["decode"].median_power_w == 100  # the entry tick is in no median


def test_nvidia_board_and_rapl_package_add_per_reader(desktop):
    rapl = counter(desktop, [0, 100_000_000, 200_000_000])
    s = Sampler(rapl, NvidiaReader(nvidia_runner(), use_nvml=False), clock=Clock(step=1.0))
    with s.phase("decode") as span:
        s.tick()
    e = s.span_energy(span)
    assert e.by_reader == {"rapl": 200.0, "nvidia": 301.5 * 2}
    assert e.joules == 200.0 + 603.0


def test_a_board_reader_that_vanishes_names_itself():
    class Board:
        name, gives_power = "nvidia", True

        def __init__(self):
            self.n = 0

        def read(self, now):
            self.n += 1
            return {"power_w": 300.0} if self.n < 3 else {}

    s = Sampler(Board(), clock=Clock(step=0.5))
    with s.phase("decode") as span:
        s.tick()
        s.tick()
    assert s.span_energy(span).joules == Unavailable("nvidia gave no reading at the phase's end")


def test_no_power_reader_says_why(vm):
    from .trees import FakeRunner

    s = Sampler.for_host(vm, FakeRunner())
    with s.phase("idle") as span:
        pass
    j = s.span_energy(span).joules
    assert isinstance(j, Unavailable)
    assert j.reason.startswith("no power reader: RAPL: no /sys/class/powercap")
    assert "nvidia-smi not found on PATH" in j.reason


def test_reader_joules_needs_the_span_covered():
    r = [Reading(1.0, True, {"power_w": 10.0}), Reading(2.0, False, {"power_w": 10.0})]
    assert reader_joules("x", r, 1.0, 2.0) == 10.0
    assert isinstance(reader_joules("x", r, 0.5, 2.0), Unavailable)
    c = [Reading(2.0, False, {ENERGY: 5.0, ENERGY_FROM: 1.0})]
    assert reader_joules("x", c, 1.0, 2.0) == 5.0
    assert PhaseEnergy(0.0, 1.0).watts == Unavailable("an empty span")


def test_nvml_energy_counters_are_summed_over_the_gpus(monkeypatch):
    import sys
    import types

    counters = {0: iter([1_000_000, 1_300_000, 1_600_000]), 1: iter([5_000, 105_000, 205_000])}   # mJ
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPowerUsage=lambda h: 1_000_000,          # 1 kW each: not what is integrated
        nvmlDeviceGetClockInfo=lambda h, kind: 2500,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(counters[h]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = Sampler(NvidiaReader(), clock=Clock(step=1.0))
    with s.phase("decode") as span:
        s.tick()
    # (300 + 100) J then (300 + 100) J, from the counters
    assert s.span_energy(span).joules == 800.0
