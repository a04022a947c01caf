"""The engine's statistics, typed: what `/health` shows under "engine" and `/metrics` exports.

Each part of the engine reports its own (`PromptCache.stats()`, `Speculator.stats()`), the
scheduler puts them together with its own counters, and the engine process sends the result
across the pipe about ten times a second. Readers use attributes, so a misspelt name fails
loudly instead of reading 0; `as_dict()` is the flat JSON shape /health has always had.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """The prompt cache: slot tier, RAM tier and disk tier."""

    cached_tokens: int = 0        # prompt positions kept in idle slots for reuse
    cache_hit_tokens: int = 0     # prompt tokens served from any tier
    inexact_hits: int = 0         # requests --prompt-cache fast served more than exact reuse would
    settled_tokens: int = 0       # reply tokens recomputed as prompt chunks while idle, to be reused
    # idle work left (the engine does it while no request runs; an A/B bench waits for none):
    unsettled_tokens: int = 0     # reply tokens of idle slots not settled yet
    unsaved_slots: int = 0        # idle slots whose kept state the disk tier has not been handed yet
    ram_bytes: int = 0
    ram_entries: int = 0
    ram_hits: int = 0
    ram_hit_tokens: int = 0
    ram_pinned_bytes: int = 0
    disk_bytes: int = 0
    disk_entries: int = 0
    disk_hits: int = 0
    disk_hit_tokens: int = 0
    disk_enabled: int = 0
    disk_pinned_bytes: int = 0
    disk_queued_bytes: int = 0    # states waiting for the disk tier's writer thread
    disk_skipped: int = 0         # states not written: the write-behind queue was full
    disk_write_errors: int = 0    # writes that failed (each loses that state only)


@dataclass(frozen=True)
class SpeculationStats:
    """Engine-wide drafting counters."""

    spec_steps: int = 0           # decode steps that verified a draft
    draft_proposed: int = 0
    draft_accepted: int = 0
    spec_committed: int = 0       # tokens committed by those steps


@dataclass(frozen=True)
class ExpertStats:
    """The torch runner's expert cache (`runners.torch.experts`): its pool and what it did."""

    slots: int = 0                # expert slots in the device pool
    experts: int = 0              # routed experts in the model, all layers
    resident: int = 0             # slots holding an expert
    lookups: int = 0              # (token, expert) pairs routed
    hits: int = 0                 # ... whose expert was in the pool
    copies: int = 0               # experts copied into the pool
    promotions: int = 0           # ... of which by the policy (the rest: misses copied in to compute)
    bytes_copied: int = 0
    host_rows: int = 0            # rows computed on the host from the experts' host copies
    compute: str = ""             # auto | cpu | device
    policy: str = ""
    copy_gb_per_s: float = 0.0    # host -> device copy bandwidth measured at start


@dataclass(frozen=True)
class EngineStats:
    steps: int = 0
    slots_busy: int = 0
    n_slots: int = 0
    queue_depth: int = 0
    tokens_generated: int = 0
    max_decode_batch: int = 0
    kv_tokens: int = 0            # positions of the pool holding a live request
    kv_capacity: int = 0          # positions of the pool
    kv_bytes: int = 0
    decode_batches: dict[int, int] = field(default_factory=dict)   # decode rows -> steps
    cache: CacheStats = field(default_factory=CacheStats)
    spec: SpeculationStats = field(default_factory=SpeculationStats)
    experts: ExpertStats | None = None   # the torch runner's expert cache, when it has one

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON object of /health's "engine" field."""
        out = {k: v for k, v in asdict(self).items() if k not in ("cache", "spec", "decode_batches", "experts")}
        out["decode_batches"] = {str(k): v for k, v in sorted(self.decode_batches.items())}
        experts = {f"expert_{k}": v for k, v in asdict(self.experts).items()} if self.experts else {}
        return {**out, **asdict(self.cache), **asdict(self.spec), **experts}
