"""The torch runner driven as the raw llama.cpp worker drives llama.cpp (`raw.py`): in a process of
its own, n_slots sequences of n_ctx positions, each prompt prefilled alone in chunks on the same
grid, then every sequence decoded together greedily (lowest id on ties), end of generation
ignored. Nothing of the server is in the path: what it times is the runner, so `appliance tune
--engines llamacpp,torch` compares the two engines on one footing (engine_choice.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .client import BenchError
from .raw_run import timed_run


class TorchWorker:  # pragma: no cover - runs in the raw worker's process
    """`raw._Llama`'s interface over the torch runner (`make_runner` with --engine torch)."""

    def __init__(self, model_path: str, st: Any) -> None:
        import numpy as np

        from ..config import EngineConfig
        from ..engine.runners import make_runner
        from ..errors import ApplianceError

        self.np, self.st, self.spec_policy = np, st, None
        try:
            cfg = EngineConfig(engine="torch", plan="off", n_slots=st.n_slots, n_ctx=st.n_ctx,
                               prefill_chunk=st.grid.chunk, **dict(st.engine_flags))
            self.runner = make_runner(cfg, Path(model_path), "raw")
        except (ApplianceError, ValueError) as e:
            raise BenchError(f"the torch runner could not load {model_path}: {getattr(e, 'message', e)}") from None

    def _argmax(self, logits: Any) -> int:
        return int(self.np.argmax(logits[-1]))

    def prefill(self, seq: int, toks: list[int]) -> int:
        from ..engine.runners.base import Span

        self.runner.truncate(seq, 0)
        out = None
        for start, end in self.st.grid.chunks(0, len(toks)):
            out = self.runner.forward([Span(seq, tuple(toks[start:end]), start, 1)])[0]
        return self._argmax(out)

    def step(self, entries: list[tuple[int, int, int]]) -> list[int]:
        from ..engine.runners.base import Span

        got = self.runner.forward([Span(seq, (tok,), pos, 1) for tok, pos, seq in entries])
        return [self._argmax(g) for g in got]

    # what speculative_run and the start-up probes ask of a runner: the runner's own
    def tokenize(self, text: str) -> list[int]:
        return self.runner.tokenize(text, add_special=False)

    @property
    def info(self) -> Any:
        return self.runner.info

    def forward(self, spans: list[Any]) -> list[Any]:
        return self.runner.forward(spans)

    def truncate(self, seq: int, pos: int) -> None:
        self.runner.truncate(seq, pos)

    def run(self, seqs: list[list[int]], n_gen: int) -> tuple[list[float], float, float, list[list[int]]]:
        """As `raw._Llama.run`: (ttft_ms per sequence, rate per stream, aggregate rate, tokens)."""
        return timed_run(self, seqs, n_gen)

    def close(self) -> None:
        self.runner.close()
