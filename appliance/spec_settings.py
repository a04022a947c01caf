"""The speculation flags (a base class of EngineConfig, config.py: its fields are serve's flags):
which drafts, from what, whether an inexact runner may draft, and the fixed decode shape that
can make llama.cpp's verify exact (engine/spec/shape.py). Declared and checked here, so the
flags stay one concept in one module; nothing here loads a model."""
from __future__ import annotations

from dataclasses import dataclass

from .flags import opt


@dataclass(frozen=True)
class SpeculationSettings:
    """--speculate and what goes with it."""

    speculate: str = opt("auto", "speculative decoding: auto (on where the runner proves at start that a k-token verify equals "
                         "k one-token steps bit for bit, else off; drafts from --draft-model, else the model's MTP head, else "
                         "prompt lookup), lookup, draft or mtp (that kind, or refuse to start), off; a request's \"speculate\" wins")
    draft_model: str | None = opt(None, "a smaller GGUF with the same vocabulary that drafts tokens greedily for "
                                  "the served model to verify ('embedded': the embedded model)")
    mtp_model: str | None = opt(None, "the model's MTP (next-n) head as a file of its own, mtp-*.gguf (default: the head in "
                                "the model's GGUF, else the mtp-*.gguf beside it that llama-server would pick)")
    draft_engine: str | None = opt(None, "runner for --draft-model: llamacpp or torch (default: --engine)")
    speculate_inexact: bool = opt(False, "allow speculation on a runner that is not exact (the output may "
                                  "differ from serial decoding; every response says so in timings)")
    fixed_shape: str = opt("auto", "llama.cpp: decode every step and verify at one fixed shape of --fixed-shape-rows rows "
                           "(spare rows inert), so a verify computes as its steps; auto: where the plain verify is not "
                           "exact, probe it at start and use it where it is exact and its spare rows cost at most 5 percent of "
                           "a step; on: use it wherever it is exact, whatever it costs (a check, a benchmark); off: never")
    fixed_shape_rows: int = opt(5, "rows of the fixed decode shape (a draft then has at most this many less one tokens)")

    def check_speculation(self) -> None:
        """ValueError naming the first flag of these that is wrong."""
        checks = [(self.speculate in ("auto", "lookup", "draft", "mtp", "off"), "speculate must be auto, lookup, draft, mtp or off"),
                  (self.draft_engine in (None, "llamacpp", "torch"), "draft_engine must be llamacpp or torch"),
                  (self.speculate != "draft" or self.draft_model is not None, "--speculate draft needs --draft-model"),
                  (self.fixed_shape in ("auto", "on", "off"), "fixed_shape must be auto, on or off"),
                  (2 <= self.fixed_shape_rows <= 64, "fixed_shape_rows must be between 2 and 64")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
