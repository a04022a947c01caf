"""The expert cache's value of an expert (`experts.ExpertCache` keeps the most valuable ones in
its device pool): how often its layer routed rows to it, decayed, or, for comparison, when."""
from __future__ import annotations

import numpy as np

DECAY = 0.9          # per call of a layer: a score halves in about 7 forwards


class FrequencyPolicy:
    """An expert's value: the rows routed to it, decayed per call of its layer."""

    name = "frequency"

    def __init__(self, n_layer: int, n_expert: int, decay: float = DECAY) -> None:
        self.decay = decay
        self.score = np.zeros((n_layer, n_expert))

    def observe(self, layer: int, counts: np.ndarray) -> None:
        self.score[layer] *= self.decay
        self.score[layer] += counts

    def value(self, layer: int, expert: int) -> float:
        return float(self.score[layer, expert])


class RecencyPolicy:
    """Least recently used, for comparison: an expert's value is when it was last routed to."""

    name = "recency"

    def __init__(self, n_layer: int, n_expert: int) -> None:
        self.clock = 0
        self.score = np.zeros((n_layer, n_expert))

    def observe(self, layer: int, counts: np.ndarray) -> None:
        self.clock += 1
        self.score[layer][counts > 0] = self.clock

    def value(self, layer: int, expert: int) -> float:
        return float(self.score[layer, expert])


POLICIES = {"frequency": FrequencyPolicy, "recency": RecencyPolicy}
