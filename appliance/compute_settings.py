"""How the engine computes on a CPU: llama.cpp's context settings in the one shape they take
everywhere (`LlamaCppSettings`: the engine config's flags, the tuned plan, `tune`'s candidates,
bench's raw reference and the runner's /health report), and how the compute threads of a process
wait (`thread_env`, a setting of the process, whichever runner computes in it).

Waiting: llama.cpp's CPU backend and torch run their threads with OpenMP (libgomp), whose
barrier spins a waiting thread for ~300,000 rounds before it sleeps. Alone on the cores that
is the fastest wait; beside anything else that computes (a second model's engine, a build,
bench's raw reference, the engine's own idle work in another process) each barrier spins away
the time slice the thread it waits for needs, and both processes slow down by one or two orders
of magnitude. "passive" makes libgomp put a waiting thread to sleep at once (OMP_WAIT_POLICY),
which must be set in a process before libgomp loads: the engine process and the raw worker do
so first thing. Passive is no free default: each barrier then costs a futex wake-up, and a lone
engine decoding the embedded model ran ~2.7x slower with it (docs/performance.md). So "spin"
is the default, "passive" the choice for a machine shared with other compute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

THREAD_WAITS = ("passive", "spin")


def thread_env(thread_wait: str) -> dict[str, str]:
    """The environment a process sets, before libgomp loads, for `thread_wait` ("spin": libgomp's
    own default, spinning then sleeping)."""
    if thread_wait not in THREAD_WAITS:
        raise ValueError(f"thread_wait must be one of {', '.join(THREAD_WAITS)}, got {thread_wait!r}")
    return {"OMP_WAIT_POLICY": "PASSIVE"} if thread_wait == "passive" else {}


@dataclass(frozen=True)
class LlamaCppSettings:
    """llama.cpp's context settings, with the threads resolved (never 0 for "auto")."""

    n_threads: int              # decode
    n_threads_batch: int        # prefill
    n_batch: int                # most tokens in one llama_decode
    n_ubatch: int               # llama.cpp's physical micro-batch
    flash_attn: bool

    def __post_init__(self) -> None:
        if min(self.n_threads, self.n_threads_batch, self.n_batch, self.n_ubatch) < 1:
            raise ValueError(f"llama.cpp's threads and batch sizes must be positive, got {self}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> LlamaCppSettings:
        """From a dict holding these keys (others ignored): /health's settings, a plan entry."""
        return cls(n_threads=int(m["n_threads"]), n_threads_batch=int(m["n_threads_batch"]),
                   n_batch=int(m["n_batch"]), n_ubatch=int(m["n_ubatch"]), flash_attn=bool(m["flash_attn"]))
