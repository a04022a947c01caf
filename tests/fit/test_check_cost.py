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
