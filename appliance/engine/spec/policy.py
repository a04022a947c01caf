"""What the engine decided about speculation at start (`decide`): which modes requests may ask
for, the default, whether the runner is exact (`Exactness`, measured by `probe.check_exact`),
and the measured costs the drafting arithmetic uses."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .cost import CostModel, DraftCost


@dataclass(frozen=True)
class Exactness:
    """Whether a k-row verify equalled k one-row steps bit for bit on the loaded model."""

    exact: bool
    max_abs_diff: float
    argmax_differs: int
    positions: int
    why: str = ""      # not exact for a reason the probe cannot see (a shared KV pool's layout)


@dataclass(frozen=True)
class DecodeShape:
    """What /health's settings.speculation.decode_shape says: the shape chosen and why."""

    mode: str = "plain"              # "plain" (one row a step) or "fixed" (every decode forward `rows` rows)
    setting: str = "auto"            # --fixed-shape
    rows: int = 0                    # the fixed shape probed (0: none was)
    exact: bool | None = None        # its verify equalled its steps bit for bit (None: not probed)
    max_abs_diff: float | None = None
    overhead: float | None = None    # a fixed-shape step's time over a plain step's
    plain_step_ms: float | None = None
    fixed_step_ms: float | None = None
    why: str = ""
    window: int = 0                  # the runner's KV window granule a verify must not cross (0: none)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Policy:
    """What the engine decided at start: which requests draft, how, and on what measured costs."""

    default: str = "off"           # for requests that do not say: "lookup", "draft", "mtp" or "off"
    modes: tuple[str, ...] = ()    # the modes a request may ask for
    inexact: bool = False          # the user allowed speculation on an inexact runner
    reason: str = "speculation is off (--speculate off)"
    cost: CostModel = field(default_factory=CostModel)
    exactness: Exactness | None = None
    k_max: int = 15
    draft: DraftCost | None = None  # the model drafter's costs (draft model or MTP head), when one is loaded
    no_mtp: str = "this server has no MTP head"   # why a request may not ask for "mtp"
    shape: DecodeShape | None = None  # the decode shape chosen at start (spec/shape.py)
    pad: int = 0                   # spare rows after a verify's last: a draft stops this far before the end
    window: int = 0                # a fixed shape's KV window granule: a verify's rows stay in one window

    def draft_room(self, room: int, start: int) -> int:
        """How many drafted tokens a verify starting at position `start` may carry: at most
        k_max and `room` (its max_tokens and context left) less the spare rows, and, at a
        fixed shape on a runner whose KV window grows in granules (llama.cpp's 256 cells),
        no more than keep every step at its rows in the verify's window. A fixed-shape
        forward at `start` fills cells up to start + rows (its spare rows included), so the
        verify's window is that rounded up to the granule, and the step at start + j's is
        start + j + rows rounded up: the draft stops where those would differ (a backend's
        kernels may split a longer window's reduction otherwise: lavapipe from 1,024 cells)."""
        k = min(self.k_max, room - self.pad)
        if self.window and self.shape is not None and self.shape.mode == "fixed":
            used = start + self.shape.rows
            k = min(k, -(-used // self.window) * self.window - used)
        return max(0, k)

    @property
    def allowed(self) -> bool:
        return bool(self.modes)

    def label(self, mode: str) -> str:
        """What a response of this mode reports in timings.speculation."""
        return mode + "-inexact" if self.inexact and mode != "off" else mode

    def refusal(self, mode: str) -> str | None:
        """Why a request may not ask for `mode` (None: it may)."""
        if mode == "off" or mode in self.modes:
            return None
        if self.modes and mode == "draft":
            return "this server has no draft model (start it with --draft-model)"
        if self.modes and mode == "mtp":
            return self.no_mtp
        return self.reason

    def as_dict(self) -> dict:
        ex = self.exactness
        return {"default": self.default, "modes": list(self.modes), "allowed": self.allowed,
                "label": self.label(self.default), "reason": self.reason, "cost": self.cost.as_dict(),
                "exact": None if ex is None else ex.exact,
                "exact_max_abs_diff": None if ex is None else ex.max_abs_diff,
                "draft": None if self.draft is None else self.draft.as_dict(),
                "mtp_refusal": None if "mtp" in self.modes else self.no_mtp,
                "decode_shape": None if self.shape is None else self.shape.as_dict()}


def decide(mode: str, inexact_ok: bool, exactness: Exactness | None, cost: CostModel,
           draft: DraftCost | None = None, model_mode: str = "draft",
           no_mtp: str = "this server has no MTP head", shape: DecodeShape | None = None) -> Policy:
    """The policy for `--speculate mode` given what the start-up check measured (and the
    model drafter's costs when one is loaded: a draft model, or the MTP head when
    `model_mode` is "mtp"; `no_mtp` says why there is no MTP head otherwise). `shape`: the
    decode shape decided at start; at a fixed shape of K rows, `exactness` is that shape's and
    a draft has at most K - 1 tokens."""
    policy = _decide(mode, inexact_ok, exactness, cost, draft, model_mode, no_mtp, shape)
    if shape is None:
        return policy
    if shape.mode == "fixed":
        return replace(policy, shape=shape, k_max=shape.rows - 1, pad=shape.rows - 1, window=shape.window,
                       reason=policy.reason + f" at a fixed shape of {shape.rows} rows ({shape.why})")
    return replace(policy, shape=shape)   # where the verify is not exact, its reason gives the shape's


def _decide(mode: str, inexact_ok: bool, exactness: Exactness | None, cost: CostModel,
            draft: DraftCost | None, model_mode: str, no_mtp: str, shape: DecodeShape | None) -> Policy:
    if mode == "off" or exactness is None:
        return Policy(reason="speculation is off (--speculate off)", cost=cost, no_mtp=no_mtp)
    modes = ("lookup", model_mode) if draft is not None else ("lookup",)
    preferred = model_mode if draft is not None else "lookup"
    if exactness.exact:
        return Policy(preferred if mode == "auto" else mode, modes, False,
                      "the runner verifies k tokens exactly as k steps", cost, exactness, draft=draft,
                      no_mtp=no_mtp)
    why = ((exactness.why or f"this runner's {exactness.positions}-row verify differs from one-token steps (max "
            f"|logit difference| {exactness.max_abs_diff:.3g}, argmax differs at "
            f"{exactness.argmax_differs} of {exactness.positions} rows)")
           + (f"; {shape.why}" if shape is not None and shape.rows else "")
           + ", so drafted tokens could change the output; start with --speculate-inexact to allow it anyway")
    if inexact_ok:
        return Policy(mode if mode != "auto" else "off", modes, True, why.split(", so")[0], cost,
                      exactness, draft=draft, no_mtp=no_mtp)
    if mode in ("lookup", "draft", "mtp"):
        raise ValueError(f"--speculate {mode}: {why}")
    return Policy(reason=why, cost=cost, exactness=exactness, no_mtp=no_mtp)


