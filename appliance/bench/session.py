"""One `bench` or `sweep` invocation: the servers it measures, the store it writes as it goes,
the host sampler, and the plan of cells it works through.

A plan is a list of steps, each one cell label x repeat x variant x target (served or raw),
ordered so that what is compared alternates (raw and served, A and B) inside each repeat
(shared/BENCHMARKING.md, rule 7). Each step's cells are stored in one transaction as soon as
they are measured, so an interrupted run (Ctrl-C, a dead server) keeps every completed cell;
the run is then marked interrupted or failed with a note naming the missing cells.
"""
from __future__ import annotations

import contextlib
import json
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..store import ModelFingerprint, ResultCell, RunStatus, Store
from . import prompt_sets
from .client import BenchError, CellFailed, Target
from .energy import served_energy, shared_energy
from .raw import RawReference, RawResult
from .timing import Measured, NoContent, StreamTrace, measure


def nonce() -> str:
    """A fresh random marker put at the very start of a prompt: no prefix cache can serve it."""
    return secrets.token_hex(6)


@dataclass
class Variant:
    """One server under measurement: the whole run's, or one side of an A/B run."""

    label: str                      # "" or "A" / "B"
    target: Target
    model_id: str
    n_ctx: int
    n_slots: int
    health: dict[str, Any] | None   # None for a server without our /health
    serve_args: list[str] = field(default_factory=list)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.target.url, "model_id": self.model_id, "n_ctx": self.n_ctx,
                               "n_slots": self.n_slots, "serve_args": self.serve_args}
        if self.health:
            out.update(self.health.get("settings") or {})
            out["model_fingerprint"] = self.health.get("model_fingerprint")
        return out


def open_variant(label: str, target: Target, claimed: ModelFingerprint | None,
                 claimed_file_fp: str | None, serve_args: Sequence[str] = ()) -> Variant:
    """Check that the server answers and serves the model the run claims, before any work."""
    ids = target.model_ids()
    if not ids:
        raise BenchError(f"{target.url} serves no model")
    health = target.health()
    if claimed is not None:
        served_fp = (health or {}).get("model_fingerprint")
        if served_fp and claimed_file_fp and served_fp != claimed_file_fp:
            raise BenchError(f"{target.url} serves {ids[0]} (file fingerprint {served_fp}), not the "
                             f"claimed model {claimed.name} ({claimed_file_fp})")
        if not served_fp and not _names_match(claimed.name, ids):
            raise BenchError(f"{target.url} serves {', '.join(ids)}, not the claimed model {claimed.name}")
    n_ctx = int((health or {}).get("n_ctx") or 0)
    n_slots = int((health or {}).get("n_slots") or 1)
    return Variant(label, target, ids[0], n_ctx, n_slots, health, list(serve_args))


def _names_match(file_name: str, ids: Sequence[str]) -> bool:
    stem = Path(file_name).stem
    return any(Path(i).name in (file_name, stem) or Path(i).stem == stem for i in ids)


# -- prompts -------------------------------------------------------------------------------

class Prompts:
    """Prompts of a given token length, built against the server's own tokenizer."""

    def __init__(self, target: Target) -> None:
        self.target = target
        sample = prompt_sets.filler(20_000, seed=0)
        self.chars_per_token = len(sample) / max(1, target.count_tokens(sample))

    def ids(self, n_tokens: int) -> list[int]:
        """Exactly n_tokens token ids (BOS included when the model adds one): a nonce, then
        filler prose in a random order."""
        chars = int(n_tokens * self.chars_per_token * 1.2) + 64
        while True:
            text = f"[{nonce()}] " + prompt_sets.filler(chars, seed=secrets.randbits(32))
            ids = self.target.tokenize(text, add_special=True)
            if len(ids) >= n_tokens:
                return ids[:n_tokens]
            chars *= 2

    def chars_for(self, n_tokens: int) -> int:
        return max(0, int(n_tokens * self.chars_per_token))


# -- measuring -----------------------------------------------------------------------------

class Phases:
    """Files the host sampler's ticks under prefill until the first token, then decode; the
    two spans give the cell its energy."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self._stack = contextlib.ExitStack()
        self.prefill: Any = None
        self.decode: Any = None

    def __enter__(self) -> Phases:
        if self.sampler is not None:
            self.prefill = self._stack.enter_context(self.sampler.phase("prefill"))
        return self

    def first_token(self) -> None:
        if self.sampler is not None:
            self._stack.close()
            self.decode = self._stack.enter_context(self.sampler.phase("decode"))

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def energy(self) -> dict[str, Any]:
        return served_energy(self.sampler, self.prefill, self.decode)


def served_cell(variant: Variant, route: str, body: dict[str, Any], sampler: Any,
                **cell: Any) -> tuple[ResultCell, StreamTrace, Measured]:
    """Stream one request and turn its trace into a cell. A request the server refused is a
    BenchError naming the cell (a needle over the limit is measured by its own code)."""
    with Phases(sampler) as phases:
        trace = variant.target.stream(route, {"model": variant.model_id, **body}, on_first=phases.first_token)
    if trace.status != 200:
        raise CellFailed(f"HTTP {trace.status}: {trace.error}")
    reported = bool((trace.usage or {}).get("prompt_tokens"))
    # counting the prompt costs a /tokenize of its whole text: only when the server said nothing
    m = measure(trace, variant.target.count_tokens, None if reported else _prompt_size(variant.target, body))
    if not reported:
        cell["extra"] = {**cell.get("extra", {}), "prompt_tokens_estimated": True}
    spec = {k: trace.timings[k] for k in ("draft_n", "draft_n_accepted", "speculation")
            if trace.timings and k in trace.timings}
    if spec.get("speculation", "off") != "off":
        cell["extra"] = {**cell.get("extra", {}), **spec}
    engine = {f"engine_{k}": round(float(trace.timings[k]), 1) for k in ("prompt_ms", "queue_ms")
              if trace.timings and isinstance(trace.timings.get(k), (int, float))}
    if engine:  # what of the TTFT the engine spent waiting and prefilling: the rest is outside it
        cell["extra"] = {**cell.get("extra", {}), **engine}
    return to_cell(m, variant=variant.label, **phases.energy(), **cell), trace, m


def _prompt_size(target: Target, body: dict[str, Any]) -> int | None:
    """The prompt's size for a server that reports no usage: exact for token ids, counted from
    the text otherwise (chat: the messages' text and the tools, without the template's tokens,
    so the cell is marked estimated)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return target.count_tokens(prompt)
    parts = [str(m.get("content") or "") for m in body.get("messages", [])]
    parts += [c["function"]["arguments"] for m in body.get("messages", []) for c in m.get("tool_calls") or []]
    if body.get("tools"):
        parts.append(json.dumps(body["tools"]))
    return target.count_tokens("\n".join(parts))


def to_cell(m: Measured, **cell: Any) -> ResultCell:
    depth = cell.pop("depth", m.prompt_tokens)
    return ResultCell(mode=cell.pop("mode", "serial"), prompt_set=cell.pop("prompt_set"), depth=depth,
                      prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens,
                      ttft_ms=m.ttft_ms, prefill_tps=m.prefill_tps, client_decode_tps=m.client_decode_tps,
                      engine_decode_tps=m.engine_decode_tps, tokens_per_step=m.tokens_per_step,
                      engine_prefill_tps=m.engine_prefill_tps, cached_tokens=m.cached_tokens, **cell)


def raw_cells(raw: RawReference, seqs: Sequence[Sequence[int]], n_gen: int, sampler: Any,
              prompt_set: str, extra: dict[str, Any], **cell: Any) -> tuple[list[ResultCell], RawResult]:
    """The raw reference for these token sequences (decoded together): one cell per sequence."""
    phase = sampler.phase("raw") if sampler is not None else contextlib.nullcontext()
    with phase as span:
        r = raw.run(seqs, n_gen)
    energy = shared_energy(sampler, span, len(seqs))
    cells = []
    for i, (seq, ttft) in enumerate(zip(seqs, r.ttft_ms)):
        e = dict(extra)
        if len(seqs) > 1:
            e.update(stream=i, aggregate_tps=r.aggregate_tps)
        cells.append(ResultCell(mode="serial", prompt_set=prompt_set, depth=len(seq),
                                prompt_tokens=len(seq), generated_tokens=n_gen, ttft_ms=ttft,
                                prefill_tps=1000.0 * len(seq) / ttft if ttft > 0 else None,
                                client_decode_tps=r.decode_tps, engine_decode_tps=None,
                                tokens_per_step=1.0, target="raw", extra=e, **energy, **cell))
    return cells, r


# -- the plan and its execution ------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    label: str                         # the planned cell ("sweep p=2048")
    repeat: int
    variant: str
    target: str                        # served or raw
    measure: Callable[[], list[ResultCell]]

    @property
    def key(self) -> str:
        who = self.target + (f" {self.variant}" if self.variant else "")
        return f"{self.label} [{who}] run {self.repeat + 1}"


def waiting_idle(steps: Sequence[Step], variants: Sequence[Variant], timeout: float = 60.0) -> list[Step]:
    """With two servers, or a server and the raw reference, each served step ends only once its
    server has no idle-time work left (`Target.wait_idle`), so that what one does after answering
    (this appliance settles replies and saves states while idle) never runs beside the other's
    measurement on the same cores."""
    if len(variants) < 2 and not any(s.target == "raw" for s in steps):
        return list(steps)
    by_label = {v.label: v for v in variants}

    def then_idle(step: Step, v: Variant) -> Step:
        def measure() -> list[ResultCell]:
            cells = step.measure()
            if not v.target.wait_idle(timeout):
                print(f"appliance: {v.target.url} still had idle work {timeout:.0f} s after {step.key}; "
                      "the next cell runs beside it", file=sys.stderr)
            return cells
        return Step(step.label, step.repeat, step.variant, step.target, measure)

    return [then_idle(s, by_label[s.variant]) if s.target == "served" and s.variant in by_label else s
            for s in steps]


@dataclass
class Outcome:
    status: RunStatus
    done: list[str]
    missing: list[str]                  # planned cells not measured: failed ones, then those never reached
    error: str = ""
    failed: list[tuple[str, str]] = field(default_factory=list)   # (cell, why) of cells the server refused

    def note(self) -> str:
        if self.status is RunStatus.COMPLETE:
            return ""
        parts = []
        if self.error:
            parts.append(f"{self.status.value} ({self.error})")
        if self.failed:
            parts.append("failed cells: " + "; ".join(f"{k}: {why}" for k, why in self.failed))
        total = len(self.done) + len(self.missing)
        parts.append(f"{len(self.missing)} of {total} cells missing: " + "; ".join(self.missing))
        return "; ".join(parts)


def execute(store: Store, run_id: int, steps: Sequence[Step], progress: bool = True) -> Outcome:
    """Measure every step in order, storing each step's cells as they come. Ctrl-C marks the
    run interrupted; a dead server or raw worker marks it failed; either way what was measured
    stays stored."""
    from tqdm import tqdm

    done: list[str] = []
    failed: list[tuple[str, str]] = []
    bar = tqdm(total=len(steps), disable=not progress, file=sys.stderr, unit="cell",
               dynamic_ncols=True, leave=False, mininterval=0.5)
    status, error = RunStatus.COMPLETE, ""
    at = 0
    try:
        for at, step in enumerate(steps):
            bar.set_description(step.key)
            try:
                cells = step.measure()
            except (CellFailed, NoContent) as e:
                failed.append((step.key, str(e)))
                bar.write(f"{step.key}: {e}", file=sys.stderr)
            else:
                store.add_cells(run_id, cells)
                done.append(step.key)
            bar.update(1)
        at = len(steps)
    except KeyboardInterrupt:
        status, error = RunStatus.INTERRUPTED, "stopped by the user"
    except BenchError as e:   # the server or the raw worker is gone: nothing more can be measured
        status, error = RunStatus.FAILED, str(e)
    finally:
        bar.close()
    if failed and status is RunStatus.COMPLETE:
        status = RunStatus.FAILED
    missing = [k for k, _ in failed] + [s.key for s in steps[at:]]
    return Outcome(status, done, missing, error, failed)


def host_snapshot(variants: Sequence[Variant] = ()) -> dict[str, Any]:
    """This host's snapshot, with the facts of every RPC worker a measured server holds layers on
    (asked of each worker: worker_facts.py), under "workers"."""
    from hostcheck import collect

    from ..worker_facts import fetch_all, remote_endpoints

    snap = collect().to_dict()
    workers = list(dict.fromkeys(ep for v in variants for ep in remote_endpoints(v.health or {})))
    return {**snap, "workers": fetch_all(workers)} if workers else snap


def peak_rss(variant: Variant) -> dict[str, int]:
    """VmHWM of the server and engine processes, when they run on this machine: the server's
    pid is known when the bench started it, the engine's comes from /health."""
    health = variant.target.health() or {}
    pids = {"server": variant.target.server.proc.pid if variant.target.server else None,
            "engine": health.get("engine_pid") if variant.target.server else None}
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration, ValueError, TypeError):
            continue
        out[name + (f" {variant.label}" if variant.label else "")] = kib * 1024
    return out


def phase_summary(sampler: Any) -> dict[str, Any]:
    """Per phase: the median power and clocks, and beside them the joules over its spans (None
    with `energy_note` saying why where the host gave none)."""
    energy = sampler.energy()
    out = {}
    for name, stats in sampler.summary().items():
        e = energy.get(name)
        known = e is not None and isinstance(e.joules, float | int)
        out[name] = {**asdict(stats), "seconds": e.seconds if e else None,
                     "joules": float(e.joules) if known else None,
                     "energy_note": "" if known or e is None else e.joules.reason,
                     "joules_by_reader": {r: j if isinstance(j, float | int) else None
                                          for r, j in (e.by_reader if e else {}).items()}}
    return out


def off_the_cpu(health: dict) -> str:
    """The devices other than the CPU that a llama.cpp server's placement puts weights on ("" for
    none): the raw reference computes on the CPU alone, so beside such a server its row would not
    mirror it (a GPU, an RPC worker)."""
    devices = (health.get("placement") or {}).get("devices") or {}
    return ", ".join(sorted(d for d, use in devices.items() if d != "CPU" and sum((use.get("weights") or {}).values())))


@contextlib.contextmanager
def maybe_raw(model_path: str | None, variant: Variant, prefill_chunk: int, want: bool) -> Iterator[RawReference | None]:
    """The raw reference worker when it can mirror the server: a local model file and the
    server's llama.cpp settings from /health (a torch server has no llama.cpp to mirror).
    Otherwise None, and the caller says why."""
    if (not want or model_path is None or not variant.health or "settings" not in variant.health
            or variant.health.get("backend", "llama.cpp") != "llama.cpp" or off_the_cpu(variant.health)):
        yield None
        return
    from .raw import RawSettings

    raw = RawReference(model_path, RawSettings.from_health(variant.health, prefill_chunk))
    try:
        yield raw
    finally:
        raw.close()
