"""Power probes: RAPL energy differences (with wraparound), hwmon watts and caps, nvidia-smi."""
from __future__ import annotations

from hostcheck.facts import Unavailable
from hostcheck.power import energy_delta_uj, probe_power

from .trees import FakeRunner, nvidia_runner


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def advancing(root, clock, zone="intel-rapl:0", energy_uj="51000000", dt=0.5):
    """A sleep that moves the fake clock and the energy counter, as real time would."""
    def sleep(seconds):
        clock.t += dt
        (root / f"sys/class/powercap/{zone}/energy_uj").write_text(energy_uj)
    return sleep


def test_apu_power_from_rapl_and_amdgpu_hwmon(apu):
    clock = Clock()
    p = probe_power(apu, FakeRunner(), sleep=advancing(apu, clock), clock=clock)
    rapl, hwmon = p.domains  # the core subzone and the control type are not listed
    assert (rapl.label, rapl.kind) == ("package-0", "rapl")
    assert rapl.power_w == 100.0  # 50 J over 0.5 s
    assert isinstance(rapl.cap_w, Unavailable) and isinstance(rapl.default_cap_w, Unavailable)
    assert (hwmon.label, hwmon.kind, hwmon.path) == ("amdgpu", "hwmon", "/sys/class/hwmon/hwmon5")
    assert (hwmon.power_w, hwmon.cap_w, hwmon.default_cap_w, hwmon.max_cap_w) == (
        69.0, 70.0, 120.0, 140.0)
    assert p.not_found == ("NVIDIA: nvidia-smi not found on PATH",)


def test_hwmon_prefers_power1_average(apu):
    (apu / "sys/class/drm/card1/device/hwmon/hwmon5/power1_average").write_text("84500000\n")
    p = probe_power(apu, FakeRunner(), sleep=lambda s: None)
    assert [d.power_w for d in p.domains if d.kind == "hwmon"] == [84.5]


def test_rapl_wraparound(desktop):
    clock = Clock()
    # the counter reads 262143.000000 J, wraps at 262143.328850 J and reads 0.128850 J 2 s later
    (desktop / "sys/class/powercap/intel-rapl:0/energy_uj").write_text("262143000000")
    sleep = advancing(desktop, clock, energy_uj="128850", dt=2.0)
    p = probe_power(desktop, nvidia_runner(), sleep=sleep, clock=clock)
    rapl = next(d for d in p.domains if d.kind == "rapl")
    assert abs(rapl.power_w - (328850 + 128850) / 1e6 / 2.0) < 1e-9
    assert rapl.cap_w == 253.0 and rapl.max_cap_w == 125.0
    assert energy_delta_uj(10, 5, None) is None and energy_delta_uj(5, 10, None) == 5


def test_nvidia_power_and_caps(desktop):
    p = probe_power(desktop, nvidia_runner(), sleep=lambda s: None)
    nv = next(d for d in p.domains if d.kind == "nvidia")
    assert (nv.label, nv.power_w, nv.cap_w, nv.default_cap_w, nv.max_cap_w) == (
        "NVIDIA GPU 0", 285.4, 450.0, 450.0, 600.0)
    assert p.not_found == ("hwmon: no power sensors under /sys/class/hwmon",)  # only coretemp
    assert [d.kind for d in p.domains] == ["rapl", "nvidia"]


def test_nothing_in_the_vm(vm):
    slept = []
    p = probe_power(vm, FakeRunner(), sleep=slept.append)
    assert p.domains == () and slept == []  # no counter to wait for
    assert p.not_found == ("RAPL: no /sys/class/powercap", "hwmon: no /sys/class/hwmon",
                           "NVIDIA: nvidia-smi not found on PATH")


def test_unreadable_energy_counter_says_so(apu):
    energy = apu / "sys/class/powercap/intel-rapl:0/energy_uj"
    energy.unlink()
    energy.mkdir()  # unreadable without root privileges looks the same to the probe: an OSError
    p = probe_power(apu, FakeRunner(), sleep=lambda s: None)
    assert isinstance(p.domains[0].power_w, Unavailable)
