"""The device check's cost as `appliance fit` estimates it (fit/check_cost.py), from the tensor
table alone: 2 FLOPs per active weight per token at the measured rate per core."""
from __future__ import annotations

import pytest

from appliance.fit.check_cost import GFLOPS_PER_CORE, active_weights, check_seconds
from appliance.fit.shapes import build


def test_a_dense_70b_costs_tens_of_seconds_on_16_cores():
    m = build("Llama-3.3-70B-Q4_K_M")
    assert 65e9 < active_weights(m) < 72e9              # every matrix but the embedding's lookup
    assert 10 < check_seconds(m, 16) < 100               # the "tens of seconds"
    assert check_seconds(m, 32) == pytest.approx(check_seconds(m, 16) / 2)


def test_a_moe_counts_the_experts_it_routes_to():
    m = build("Qwen3-30B-A3B-Q4_K_M")                    # 30B stored, about 3B active
    assert 2e9 < active_weights(m) < 4.5e9
    assert check_seconds(m, 8) == pytest.approx(2 * active_weights(m) * 101 / (8 * GFLOPS_PER_CORE * 1e9))


def test_where_the_whole_cpu_side_would_not_fit_the_slice_is_estimated():
    """engine/device_partial.py compares the first and last two layers and the output head
    where the whole model's CPU side does not fit; fit estimates that instead, and says so."""
    from types import SimpleNamespace

    from appliance.fit.check_cost import slice_layers
    from appliance.fit.command import _check_cost
    from appliance.fit.planner import Use

    m = build("Llama-3.3-70B-Q4_K_M")
    assert slice_layers(m) == frozenset({0, 1, m.n_layer - 2, m.n_layer - 1})
    sliced = check_seconds(m, 16, layers=slice_layers(m))
    assert sliced < check_seconds(m, 16) / 10            # four of 80 layers and the head
    gpu = Use({"attn": 40 * 2**30}, 0, 0, 48 * 2**30)
    roomy = SimpleNamespace(n_gpu_layers=81, use={"GPU0": gpu, "CPU": Use({}, 0, 0, 64 * 2**30)})
    tight = SimpleNamespace(n_gpu_layers=81, use={"GPU0": gpu, "CPU": Use({"embed": 2 * 2**30}, 0, 0, 30 * 2**30)})
    whole, part = _check_cost(m, roomy), _check_cost(m, tight)
    assert whole[3] == "the whole model" and part[3].startswith(f"layers 0, 1, {m.n_layer - 2}, {m.n_layer - 1} and "
                                                                "the output head: the whole model's CPU side, 40.1 GiB")
    assert part[0] < whole[0] / 10 and _check_cost(m, SimpleNamespace(n_gpu_layers=0, use={})) is None
