"""What the device check (device_check.py) measures and says: its text, the device it compares,
and the verdict, which /health, the start-up log, hostcheck and the cache all carry.

The check's text is CHECK_TEXT with the model's BOS, 64 to 128 tokens (check_ids). A verdict is
agrees, differs (with what passed its limit) or skipped (with why); `describe` is the log's line
and `refusal` the start's error.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .logit_compare import Tolerance
from .runners.base import ModelRunner

# 64 to 128 tokens in the usual BPE vocabularies (SmolLM2's: 101); plain prose, no template
CHECK_TEXT = ("The lighthouse stood on a low island of black rock, two miles from the harbour. Every "
              "evening the keeper climbed the spiral stairs, trimmed the wick, wound the clockwork that "
              "turned the lens, and wrote the weather in a book: wind from the west, rain after midnight, "
              "a fishing boat late but safe. In winter the storms came one after another, and the keeper "
              "counted the hours by the beam sweeping the water, once every ten seconds, all night long.")
MIN_TOKENS, MAX_TOKENS = 64, 128
TOLERANCE = Tolerance()
NO_GPU = "no layer on a GPU"
MARGIN = 64 * 2**20   # beyond a side's weights: a context and its buffers for about 100 tokens


@dataclass(frozen=True)
class Target:
    """What the check compares: the device holding layers and what of the model it holds."""

    name: str              # llama.cpp's (Vulkan0, CUDA0, ROCm0) or torch's (cuda:0)
    description: str       # llvmpipe (LLVM 15.0.6, 256 bits), NVIDIA H100 80GB HBM3
    holds: str             # "31 of 31 layers and the output"
    cpu_side_bytes: int    # what the CPU side needs beyond the page cache, estimated
    handle: int | None = None   # llama.cpp's ggml_backend_dev_t (None: the CPU standing in, tests)
    host_memory: bool = False   # the device's memory is the host's (an APU, lavapipe)


@dataclass(frozen=True)
class DeviceVerdict:
    verdict: str                           # agrees | differs | skipped
    device: str = ""
    driver: str = ""
    build: str = ""
    model_sha256: str = ""
    checked: str = ""                      # what was compared, in words
    comparison: dict = field(default_factory=dict)   # LogitComparison.as_dict()
    differed: tuple[str, ...] = ()
    tolerance: dict = field(default_factory=dict)
    device_s: float = 0.0
    cpu_s: float = 0.0
    why: str = ""                          # skipped: why
    cached: bool = False
    engine: str = "llamacpp"               # whose CPU side: llamacpp (its CPU backend) | torch (its CPU path)

    def report(self, mode: str) -> dict:
        """/health's settings.device_check."""
        return {"mode": mode, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}}

    def refusal(self) -> str:
        """The start's refusal: the device, the build and what differed."""
        cpu, flag, build = (("the torch runner's CPU path", "--torch-device cpu", "torch") if self.engine == "torch"
                            else ("llama.cpp's CPU backend", "--n-gpu-layers 0", "llama.cpp"))
        return (f"the device check failed: {self.device} (driver {self.driver}; {self.build}) does not compute "
                f"what {cpu} computes on the same file ({self.checked}): "
                f"{'; '.join(self.differed)}. Serve on the CPU ({flag}), change the driver or the "
                f"{build} build, or start anyway with --device-check warn")

    def describe(self) -> str:
        if self.verdict == "skipped":
            return f"skipped: {self.why}"
        c = self.comparison
        return (f"{self.verdict} on {self.device} ({self.checked}{', remembered' if self.cached else ''}): "
                f"argmax agreement {c['argmax_agree']:.1%}, max |logit difference| {c['max_abs_diff']:.3g}, "
                f"KL mean {c['kl_mean']:.3g} max {c['kl_max']:.3g} nats, perplexity {c['ppl_device']:.4g} "
                f"device / {c['ppl_cpu']:.4g} CPU; {self.device_s:.2f} s on the device, {self.cpu_s:.2f} s on the "
                "CPU")


def check_ids(runner: ModelRunner) -> list[int]:
    """The check's tokens: CHECK_TEXT with the model's BOS, at most MAX_TOKENS and the context."""
    ids = runner.tokenize(CHECK_TEXT, add_special=True)
    while len(ids) < MIN_TOKENS:              # a vocabulary of long tokens: the text again
        ids += runner.tokenize(" " + CHECK_TEXT, add_special=False)
    return ids[:min(MAX_TOKENS, runner.info.n_ctx - 1)]


