"""The power envelope as an A/B setting: `bench --power-cap W1,W2,...` (and sweep).

Which cap: the GPU's where the host has one (every NVIDIA GPU's power limit through
`nvidia-smi -pl`, an amdgpu's hwmon `power1_cap`), else RAPL's long-term package limit
(`constraint_0_power_limit_uw`): the same kind of control on every device of that kind.

Every control is checked before anything starts (writable, or root for nvidia-smi; each watt
value inside the allowed range), so a run that cannot set a cap is refused at start with what
to run. The originals are read then, written to a journal file, and restored on every way out:
the context manager's exit (an error, a dead server, Ctrl-C, and SIGTERM, turned into Ctrl-C
while caps are changed), and a write failing half way restores at once what was already set.
A bench killed outright (kill -9) cannot restore; the next `bench --power-cap` finds the journal
and restores from it first.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hostcheck.facts import Fs, Runner, Unavailable, known, run_command
from hostcheck.power import PowerDomain, probe_power

from .client import BenchError


class CapRefused(BenchError):
    """The caps cannot be set on this host (no control, no permission, a value out of range)."""


class CapError(BenchError):
    """Setting or restoring a cap failed; the message says what was restored."""


@dataclass(frozen=True)
class Control:
    label: str                 # "NVIDIA GPU 0", "amdgpu", "package-0"
    kind: str                  # nvidia, hwmon, rapl
    target: str                # the sysfs file, or the GPU index for nvidia-smi
    original_w: float
    min_w: float | None
    max_w: float | None


def controls(domains: Sequence[PowerDomain]) -> list[Control]:
    """The caps `--power-cap` sets: every domain of the first kind that has a readable cap."""
    for kind in ("nvidia", "hwmon", "rapl"):
        found = [d for d in domains if d.kind == kind and known(d.cap_w)]
        if found:
            return [Control(d.label, kind, _target(d), float(d.cap_w),  # type: ignore[arg-type]
                            d.min_cap_w if known(d.min_cap_w) else None,  # type: ignore[arg-type]
                            d.max_cap_w if known(d.max_cap_w) else None) for d in found]  # type: ignore[arg-type]
    return []


def _target(d: PowerDomain) -> str:
    if d.kind == "nvidia":
        return d.label.rsplit(" ", 1)[-1]
    return f"{d.path}/power1_cap" if d.kind == "hwmon" else f"{d.path}/constraint_0_power_limit_uw"


class PowerCaps:
    """Sets every control to one cap at a time; restores the originals on exit."""

    def __init__(self, found: Sequence[Control], root: str | Path = "/", run: Runner = run_command,
                 journal: Path | None = None, settle_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.controls, self.fs, self.run = list(found), Fs(root), run
        self.journal, self.settle_s, self.sleep = journal, settle_s, sleep
        self.current: float | None = None     # what every control is set to, None = originals
        self._changed = False                 # some control may differ from its original

    @classmethod
    def for_host(cls, watts: Sequence[float], root: str | Path = "/", run: Runner = run_command,
                 journal: Path | None = None, can_write: Callable[[Path], bool] | None = None,
                 is_root: Callable[[], bool] | None = None, **kw: Any) -> PowerCaps:
        """Checked before the run: CapRefused says why and what to run."""
        if journal is not None and journal.exists():
            restore_journal(journal, root, run)
        found = controls(probe_power(root, run, interval_s=0.0, sleep=lambda s: None).domains)
        if not found:
            raise CapRefused("--power-cap: this host exposes no settable power cap (no NVIDIA power limit, "
                             "no hwmon power1_cap, no RAPL constraint_0_power_limit_uw)")
        caps = cls(found, root, run, journal, **kw)
        caps._check(watts, can_write or (lambda p: os.access(p, os.W_OK)),
                    is_root or (lambda: os.geteuid() == 0))
        return caps

    def _check(self, watts: Sequence[float], can_write: Callable[[Path], bool], is_root: Callable[[], bool]) -> None:
        for c in self.controls:
            if c.kind == "nvidia" and not is_root():
                raise CapRefused(f"--power-cap: setting {c.label}'s power limit (nvidia-smi -pl) needs root: "
                                 f"run `sudo {_argv()}`")
            if c.kind != "nvidia" and not can_write(self.fs.path(c.target)):
                raise CapRefused(f"--power-cap: {c.target} is not writable by this user: run `sudo {_argv()}`, "
                                 f"or as root once: `chmod o+w {c.target}` (reset at boot)")
            for w in watts:
                if (c.min_w is not None and w < c.min_w) or (c.max_w is not None and w > c.max_w):
                    raise CapRefused(f"--power-cap {w:g} W is outside {c.label}'s allowed range "
                                     f"{_range(c)}")

    def __enter__(self) -> PowerCaps:
        self._old_term = None
        if sys.platform != "win32":
            try:   # SIGTERM ends the run as Ctrl-C does, so the caps are restored
                self._old_term = signal.signal(signal.SIGTERM, _as_interrupt)
            except ValueError:   # not the main thread: the caller handles its own signals
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.restore()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)

    def set(self, watts: float) -> None:
        """Every control to `watts`; a write failing half way restores them all, then raises."""
        if self.current == watts:
            return
        self._write_journal()
        self._changed = True
        try:
            for c in self.controls:
                self._write(c, watts)
        except CapError as e:
            self.restore()
            raise CapError(f"{e}; every cap restored to its original") from e
        self.current = watts
        self.sleep(self.settle_s)

    def restore(self) -> None:
        """The original of every control (all are tried; the first failure is raised after)."""
        if not self._changed and not (self.journal and self.journal.exists()):
            return
        errors = []
        for c in self.controls:
            try:
                self._write(c, c.original_w)
            except CapError as e:
                errors.append(str(e))
        self.current, self._changed = None, bool(errors)
        if errors:
            raise CapError("restoring the original caps failed: " + "; ".join(errors))
        if self.journal is not None:
            self.journal.unlink(missing_ok=True)

    def _write(self, c: Control, watts: float) -> None:
        if c.kind == "nvidia":
            out = self.run(["nvidia-smi", "-i", c.target, "-pl", f"{watts:g}"])
            if isinstance(out, Unavailable):
                raise CapError(f"setting {c.label} to {watts:g} W failed: {out.reason}")
            return
        uw = str(int(round(watts * 1e6)))
        try:
            self.fs.path(c.target).write_text(uw + "\n")
        except OSError as e:
            raise CapError(f"setting {c.label} to {watts:g} W failed: {c.target}: "
                           f"{e.strerror or type(e).__name__}") from e
        back = self.fs.read_int(c.target)
        if back != int(uw):
            raise CapError(f"setting {c.label} to {watts:g} W failed: {c.target} reads {back} afterwards")

    def _write_journal(self) -> None:
        if self.journal is not None and not self._changed:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            self.journal.write_text(json.dumps([asdict(c) for c in self.controls]))


def restore_journal(journal: Path, root: str | Path = "/", run: Runner = run_command) -> None:
    """The caps a run killed outright left changed, back to their originals."""
    found = [Control(**c) for c in json.loads(journal.read_text())]
    caps = PowerCaps(found, root, run, journal, settle_s=0.0)
    print("appliance: restoring power caps left changed by an earlier run: "
          + ", ".join(f"{c.label} {c.original_w:g} W" for c in found), file=sys.stderr)
    caps.restore()


def _as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _range(c: Control) -> str:
    lo = f"{c.min_w:g}" if c.min_w is not None else "?"
    hi = f"{c.max_w:g}" if c.max_w is not None else "?"
    return f"{lo}..{hi} W"


def _argv() -> str:
    return " ".join(["appliance", *sys.argv[1:]]) if sys.argv else "appliance bench ..."


def label(watts: float) -> str:
    return f"{watts:g} W"


def enveloped(steps: Sequence[Any], caps: PowerCaps, watts: Sequence[float]) -> list[Any]:
    """Each step once under every cap, the caps alternated (W1 W2, then W2 W1 on the next
    repeat) as A/B runs are; the cells carry the cap and, as their variant, its label."""
    from .session import Step

    def under(step: Any, w: float) -> Any:
        def measure() -> list[Any]:
            caps.set(w)
            return [replace(c, power_cap_w=w, variant=label(w)) for c in step.measure()]
        return Step(step.label, step.repeat, label(w), step.target, measure)

    out = []
    for step in steps:
        order = list(watts) if step.repeat % 2 == 0 else list(reversed(watts))
        out += [under(step, w) for w in order]
    return out
