"""What a cached prompt state is worth: the time its tokens would take to recompute, from the
engine's own measured prefill rates by depth (`PrefillCost`), per byte it holds, halved for
every `HALF_LIFE_S` it goes unused. Both tiers evict the least valuable entry first, so a long
conversation (dear to recompute: attention grows with depth) outlives many short ones.
"""
from __future__ import annotations

HALF_LIFE_S = 600.0
BUCKET = 1024  # depth resolution of the prefill cost model, in tokens


class PrefillCost:
    """Milliseconds per prompt token by depth, learned from the engine's own prefill chunks
    (an exponential average per 1,024-token bucket). Buckets never measured are extrapolated
    from the deepest measured one, assuming per-token cost grows linearly with depth."""

    def __init__(self) -> None:
        self.ms_per_token: dict[int, float] = {}

    def observe(self, start_pos: int, n_tokens: int, ms: float) -> None:
        if n_tokens <= 0 or ms <= 0:
            return
        b = (start_pos + n_tokens // 2) // BUCKET
        old = self.ms_per_token.get(b)
        rate = ms / n_tokens
        self.ms_per_token[b] = rate if old is None else 0.8 * old + 0.2 * rate

    def rate(self, bucket: int) -> float:
        if bucket in self.ms_per_token:
            return self.ms_per_token[bucket]
        if not self.ms_per_token:
            return 1.0 + bucket * 0.5  # nothing measured yet: the shape alone
        known = max(b for b in self.ms_per_token if b <= bucket) if any(
            b <= bucket for b in self.ms_per_token) else min(self.ms_per_token)
        base = self.ms_per_token[known]
        return base * (1.0 + bucket) / (1.0 + known)

    def cost_ms(self, n_tokens: int) -> float:
        full, rest = divmod(n_tokens, BUCKET)
        return sum(BUCKET * self.rate(b) for b in range(full)) + rest * self.rate(full)


def value(cost_ms: float, size: int, idle_s: float) -> float:
    """What keeping an entry is worth: recompute milliseconds per byte, halved per HALF_LIFE_S idle."""
    return cost_ms / max(1, size) * 0.5 ** (max(0.0, idle_s) / HALF_LIFE_S)


