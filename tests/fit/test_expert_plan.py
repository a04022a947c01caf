"""The expert half of the fit planner (fit/experts.py): how many expert slots the torch runner's
device cache gets, from the device's memory, what else it holds and the experts' sizes."""
from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.fit.devices import GIB, Device
from appliance.fit.experts import parse_setting, plan_experts

CARD = Device("GPU0", "gpu", 22 * GIB)
APU = Device("GPU0", "gpu", 96 * GIB, unified=True, carve_out=8 * GIB)
MIB = 1024**2


def plan(setting="auto", compute="auto", device=CARD, resident=6 * GIB, n=48 * 128, size=9 * MIB):
    return plan_experts(setting, compute, n_experts=n, expert_bytes=size, device=device, resident_bytes=resident)


def test_a_card_too_small_for_every_expert_gets_as_many_slots_as_fit_beside_the_rest():
    p = plan()   # 6,144 experts of 9 MiB (54 GiB), 16 GiB free after the rest
    assert p.slots == (16 * GIB) // (9 * MIB) == 1820 and p.compute == "auto"
    assert "1820 of 6144" in p.reason


def test_no_cache_where_every_expert_fits_on_a_cpu_or_on_an_apu():
    assert plan(n=48 * 8).slots is None                  # 3.4 GiB of experts fit in 16 GiB
    assert plan(device=None).slots is None and "CPU only" in plan(device=None).reason
    assert plan(device=Device("CPU", "cpu", 20 * GIB)).slots is None
    assert plan(device=APU).slots is None and "maps host memory" in plan(device=APU).reason


def test_no_room_at_all_computes_every_expert_on_the_host():
    p = plan(resident=30 * GIB)
    assert p.slots == 0 and p.compute == "cpu"
    assert plan(resident=30 * GIB, compute="device").compute == "device"   # the user's choice stays


def test_explicit_settings_win_and_are_capped_at_the_expert_count():
    assert plan("64", device=None).slots == 64
    assert plan("100000").slots == 48 * 128
    assert plan("off").slots is None and plan("OFF").slots is None
    assert plan("auto", n=0).slots is None and "no routed experts" in plan(n=0).reason


@pytest.mark.parametrize("bad", ["-1", "lots", "1.5", ""])
def test_a_malformed_cache_setting_is_refused(bad):
    with pytest.raises(ValueError, match="expert_cache"):
        parse_setting(bad)
    with pytest.raises(ValueError, match="expert_cache"):
        EngineConfig(engine="torch", expert_cache=bad)


def test_the_flags_apply_to_the_torch_runner_only():
    with pytest.raises(ValueError, match="torch runner"):
        EngineConfig(expert_cache="8")
    with pytest.raises(ValueError, match="expert_compute"):
        EngineConfig(engine="torch", expert_compute="gpu")
    assert EngineConfig(engine="torch", expert_cache="8", expert_compute="cpu").expert_cache == "8"
