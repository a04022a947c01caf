"""`bench --power-cap`: the caps set per cell, alternated, and restored on every way out, on the
fixture APU's hwmon power1_cap and a fake nvidia-smi."""
from __future__ import annotations

import os
import signal

import pytest

from appliance.bench.client import ServerGone
from appliance.bench.envelope import CapError, CapRefused, Control, PowerCaps, controls, enveloped
from appliance.bench.session import Step, execute
from appliance.store import RunStatus, Store
from hostcheck.power import probe_power
from tests.hostcheck import trees

from .test_execute import FP, cell

CAP = trees.APU_HWMON.lstrip("/") + "/power1_cap"


@pytest.fixture
def apu(tmp_path):
    root = trees.build(tmp_path / "apu", trees.strix_halo())
    (root / trees.APU_HWMON.lstrip("/") / "power1_cap_min").write_text("45000000\n")
    return root


def cap_w(root):
    return int((root / CAP).read_text()) / 1e6


def open_caps(root, watts=(60.0, 90.0), **kw):
    kw.setdefault("can_write", lambda p: True)
    return PowerCaps.for_host(watts, root, trees.FakeRunner(), journal=root / "caps.json", settle_s=0.0, **kw)


def test_the_apu_cap_is_its_amdgpu_hwmon_with_its_range(apu):
    found = controls(probe_power(apu, trees.FakeRunner(), interval_s=0.0, sleep=lambda s: None).domains)
    assert found == [Control("amdgpu", "hwmon", "/sys/class/hwmon/hwmon5/power1_cap", 70.0, 45.0, 140.0)]


def test_two_envelopes_alternate_and_the_original_comes_back(apu):
    seen = []

    def step(label, repeat):
        def measure():
            seen.append((label, repeat, cap_w(apu)))
            return [cell(label)]
        return Step(label, repeat, "", "served", measure)

    with open_caps(apu) as caps:
        steps = enveloped([step("p=512", 0), step("p=512", 1)], caps, (60.0, 90.0))
        assert [s.key for s in steps] == ["p=512 [served 60 W] run 1", "p=512 [served 90 W] run 1",
                                          "p=512 [served 90 W] run 2", "p=512 [served 60 W] run 2"]
        cells = [c for s in steps for c in s.measure()]
    assert seen == [("p=512", 0, 60.0), ("p=512", 0, 90.0), ("p=512", 1, 90.0), ("p=512", 1, 60.0)]
    assert [(c.power_cap_w, c.variant) for c in cells] == [(60.0, "60 W"), (90.0, "90 W"), (90.0, "90 W"),
                                                           (60.0, "60 W")]
    assert cap_w(apu) == 70.0 and not (apu / "caps.json").exists()


@pytest.mark.parametrize("exc, status", [(KeyboardInterrupt(), RunStatus.INTERRUPTED),
                                         (ServerGone("the server exited with code -9"), RunStatus.FAILED)])
def test_an_interrupted_run_or_a_killed_server_restores_the_cap(apu, tmp_path, exc, status):
    def interrupted():
        assert cap_w(apu) == 90.0
        raise exc

    with Store.open(tmp_path / "r.db") as store, open_caps(apu) as caps:
        run_id = store.start_run(["test"], {}, FP)
        steps = enveloped([Step("a", 0, "", "served", lambda: [cell("a")]),
                           Step("b", 0, "", "served", lambda: [cell("b")])], caps, (60.0, 90.0))
        steps[3] = Step("b", 0, "90 W", "served", lambda: (caps.set(90.0), interrupted()))
        outcome = execute(store, run_id, steps, progress=False)
        assert outcome.status is status and len(store.results(run_id)) == 3
        assert cap_w(apu) == 90.0          # still changed until the run's stack closes
    assert cap_w(apu) == 70.0


def test_sigterm_during_a_run_restores_the_cap(apu):
    with pytest.raises(KeyboardInterrupt):
        with open_caps(apu) as caps:
            caps.set(60.0)
            os.kill(os.getpid(), signal.SIGTERM)
    assert cap_w(apu) == 70.0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_refused_at_start_without_permission_or_out_of_range(apu):
    with pytest.raises(CapRefused, match=r"power1_cap is not writable by this user: run `sudo "):
        open_caps(apu, can_write=lambda p: False)
    with pytest.raises(CapRefused, match=r"150 W is outside amdgpu's allowed range 45..140 W"):
        open_caps(apu, watts=(60.0, 150.0))
    assert cap_w(apu) == 70.0 and not (apu / "caps.json").exists()


def test_a_host_without_a_cap_is_refused(tmp_path):
    root = trees.build(tmp_path / "vm", trees.bare_vm())
    with pytest.raises(CapRefused, match="exposes no settable power cap"):
        open_caps(root)


def test_a_run_killed_outright_leaves_a_journal_the_next_run_restores(apu):
    caps = open_caps(apu)
    caps.set(60.0)                      # then kill -9: no exit, no restore
    assert cap_w(apu) == 60.0 and (apu / "caps.json").exists()
    with open_caps(apu) as again:       # the next --power-cap run restores before anything
        assert cap_w(apu) == 70.0 and again.controls[0].original_w == 70.0
    assert not (apu / "caps.json").exists()


class FakeSmi:
    """Two GPUs; `-pl` on GPU 1 fails when `fail_on` says so."""

    def __init__(self, fail_on=None):
        self.limits, self.fail_on, self.calls = {"0": 300.0, "1": 300.0}, fail_on, []

    def __call__(self, argv):
        if "-pl" in argv:
            gpu, w = argv[argv.index("-i") + 1], float(argv[argv.index("-pl") + 1])
            self.calls.append((gpu, w))
            if gpu == self.fail_on and w != 300.0:
                return trees.Unavailable("nvidia-smi exited 4: Insufficient Permissions")
            self.limits[gpu] = w
            return ""
        if "power.default_limit" in argv[1]:
            return "".join(f"{i}, 200.0, {w}, 300.0, 450.0, 150.0\n" for i, w in self.limits.items())
        return trees.NV_GPU_ROW


def test_a_write_failing_half_way_restores_what_was_set(tmp_path):
    root = trees.build(tmp_path / "desk", trees.nvidia_desktop())
    smi = FakeSmi(fail_on="1")
    caps = PowerCaps.for_host([250.0], root, trees.FakeRunner({"nvidia-smi": smi}), is_root=lambda: True,
                              settle_s=0.0)
    assert [c.target for c in caps.controls] == ["0", "1"]   # every NVIDIA GPU, not RAPL
    with pytest.raises(CapError, match="setting NVIDIA GPU 1 to 250 W failed: .*every cap restored"):
        with caps:
            caps.set(250.0)
    assert smi.limits == {"0": 300.0, "1": 300.0}
    assert smi.calls == [("0", 250.0), ("1", 250.0), ("0", 300.0), ("1", 300.0)]


def test_nvidia_needs_root(tmp_path):
    root = trees.build(tmp_path / "desk", trees.nvidia_desktop())
    with pytest.raises(CapRefused, match=r"needs root: run `sudo "):
        PowerCaps.for_host([250.0], root, trees.FakeRunner({"nvidia-smi": FakeSmi()}), is_root=lambda: False)


@pytest.mark.parametrize("host, why", [("vm", "exposes no settable power cap"),
                                       ("apu", "power1_cap is not writable by this user: run `sudo ")])
def test_sweep_refuses_before_any_server_starts(tmp_path, monkeypatch, capsys, host, why):
    from appliance.bench import client
    from appliance.cli import main

    root = trees.build(tmp_path / host, trees.bare_vm() if host == "vm" else trees.strix_halo())
    real = PowerCaps.for_host.__func__
    monkeypatch.setattr(PowerCaps, "for_host", classmethod(
        lambda cls, watts, **kw: real(cls, watts, root, trees.FakeRunner(), can_write=lambda p: False, **kw)))
    monkeypatch.setattr(client, "serving", lambda *a, **k: pytest.fail("a server was started"))
    code = main(["sweep", "-p", "64", "--power-cap", "60,90", "--db-path", str(tmp_path / "r.db")])
    assert code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "r.db").exists()
