"""The tuned plan: engine settings measured once on this machine by `appliance tune`, read at
start so every process makes the same choices (issue #9).

    {"version": 1,
     "fingerprint": {"appliance": "0.1.0", "kernel_sources": "<sha256>", "llama_cpp_python": "0.3.36",
                     "llama_cpp_build": "...", "torch": "absent", "triton": "absent", "backend": "llama.cpp-cpu",
                     "device": "AMD EPYC ...", "arch": "x86_64", "runtime": "none", "cpu_model": "..."},
     "created_at": "...",
     "llamacpp": {"<model fingerprint>": [
         {"depth_max": 1024, "n_threads": 2, "n_threads_batch": 2, "n_batch": 512, "n_ubatch": 512,
          "flash_attn": false, "measured": {...what was timed...}},
         ...]}}

A plan is used whole or not at all: its fingerprint must equal this machine's and software's
field for field, or it is refused with a log line naming the fields that differ. Lookups are
pure functions of the plan and the key. A key the plan does not hold (another model) is a
miss: the engine keeps its fixed defaults, counts the miss and records the key in
`<plan>.misses.json`, which `appliance tune` reads to measure what was missed. At engine start
`apply` fills the llama.cpp settings that flags and environment left at their defaults.

Optional per model file: "engines", the engine `tune --engines llamacpp,torch` chose for
`--engine auto`, and "thread_wait", how threads wait for `--thread-wait auto` (engine_choice.py).

The optional "gemm" section holds the torch runner's tuned GEMM configs (`kernels.plan`: its
form, buckets and exactness rule): {"fingerprint": {...the GPU, runtime, torch, Triton, kernel
sources...}, "entries": [...]}. It has its own fingerprint because it describes the GPU, not
llama.cpp, and it is judged on that alone: `load_gemm` uses it only when that fingerprint equals
this GPU's field for field. `Plan` keeps the section as plain JSON (a llama.cpp-only install has
no torch to build a table with); `load_gemm` validates it into a `GemmTable`. Missed GEMM shapes
go to the same misses file, as {"op": "wgemm", "fmt", "n", "k", "bucket"}.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import __version__
from ..compute_settings import LlamaCppSettings
from ..config import EngineConfig
from ..models import file_fingerprint

log = logging.getLogger("appliance.plan")

PLAN_VERSION = 1


class PlanRefused(ValueError):
    """The plan file cannot be used: corrupt, another version, or another machine's."""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def kernel_sources_hash() -> str:
    """sha256 over the runners' sources: a plan tuned for other kernels is another plan."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent / "runners"
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cpu_model(root: str | Path = "/") -> str:
    try:
        for line in (Path(root) / "proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def llama_cpp_build() -> str:
    """llama.cpp's system info line: the CPU features and backends it was compiled with."""
    import llama_cpp  # the engine and `tune` have it loaded already

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def current_fingerprint(llama_cpp_build: str = "", device: str | None = None) -> dict[str, str]:
    """What a plan's measurements depend on. `llama_cpp_build` is llama.cpp's system info line
    (its compiled CPU features), given by a caller that has llama_cpp loaded."""
    cpu = cpu_model()
    return {"appliance": __version__, "kernel_sources": kernel_sources_hash(),
            "llama_cpp_python": _version("llama_cpp_python"), "llama_cpp_build": llama_cpp_build,
            "torch": _version("torch"), "triton": _version("triton"), "backend": "llama.cpp-cpu",
            "device": device or cpu, "arch": platform.machine(), "runtime": "none", "cpu_model": cpu}


@dataclass(frozen=True)
class LlamaCppChoice:
    """llama.cpp settings for contexts up to `depth_max` positions (the last entry: any depth)."""

    depth_max: int
    settings: LlamaCppSettings
    measured: Mapping[str, Any] = field(default_factory=dict)

    def to_entry(self) -> dict[str, Any]:
        """The plan file's entry: the settings flat beside depth_max and measured."""
        return {"depth_max": self.depth_max, **self.settings.as_dict(), "measured": dict(self.measured)}

    @classmethod
    def from_entry(cls, e: Mapping[str, Any]) -> LlamaCppChoice:
        return cls(depth_max=int(e["depth_max"]), settings=LlamaCppSettings.from_mapping(e),
                   measured=dict(e.get("measured", {})))


@dataclass(frozen=True)
class Plan:
    fingerprint: Mapping[str, str]
    llamacpp: Mapping[str, tuple[LlamaCppChoice, ...]]   # model fingerprint -> entries by depth_max
    created_at: str = ""
    version: int = PLAN_VERSION
    gemm: Mapping[str, Any] | None = None   # the "gemm" section as JSON (`kernels.plan.GemmTable.to_json`)
    engines: Mapping[str, Any] | None = None   # model fingerprint -> {"engine", "why", "measured"} (engine_choice)
    thread_waits: Mapping[str, Any] | None = None   # model fingerprint -> {"thread_wait", "why", "measured"}

    def to_json(self) -> str:
        body = {"version": self.version, "fingerprint": dict(self.fingerprint), "created_at": self.created_at,
                "llamacpp": {m: [c.to_entry() for c in cs]
                             for m, cs in sorted(self.llamacpp.items())}}
        if self.gemm is not None:       # absent, not null: a plan without one reads as it always has
            body["gemm"] = self.gemm
        if self.engines:
            body["engines"] = dict(self.engines)
        if self.thread_waits:
            body["thread_wait"] = dict(self.thread_waits)
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def lookup(self, model: str, depth: int) -> LlamaCppChoice | None:
        """The entry for this model covering `depth` (the first whose depth_max >= depth, else the
        last); None when the plan has nothing for this model."""
        entries = self.llamacpp.get(model)
        if not entries:
            return None
        return next((c for c in entries if depth <= c.depth_max), entries[-1])


def parse(text: str, source: str = "plan") -> Plan:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise PlanRefused(f"{source} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
        raise PlanRefused(f"{source} is not a version-{PLAN_VERSION} plan "
                          f"(version {doc.get('version') if isinstance(doc, dict) else None!r})")
    try:
        fp = {str(k): str(v) for k, v in doc["fingerprint"].items()}
        llamacpp = {}
        for model, entries in doc.get("llamacpp", {}).items():
            # LlamaCppSettings refuses counts below 1
            choices = tuple(sorted((LlamaCppChoice.from_entry(e) for e in entries), key=lambda c: c.depth_max))
            if not choices:
                raise ValueError(f"no entries for {model}")
            llamacpp[str(model)] = choices
        gemm = doc.get("gemm")
        if gemm is not None and not (isinstance(gemm, dict) and isinstance(gemm.get("fingerprint"), dict)
                                     and isinstance(gemm.get("entries"), list)):
            raise ValueError('the gemm section must be {"fingerprint": {...}, "entries": [...]}')
        engines = doc.get("engines")
        if engines is not None and not all(e.get("engine") in ("llamacpp", "torch") for e in engines.values()):
            raise ValueError('the engines section must be {"<model>": {"engine": "llamacpp" or "torch", ...}}')
        waits = doc.get("thread_wait")
        if waits is not None and not all(w.get("thread_wait") in ("spin", "passive") for w in waits.values()):
            raise ValueError('the thread_wait section must be {"<model>": {"thread_wait": "spin" or "passive", ...}}')
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanRefused(f"{source} is malformed ({e})") from None
    return Plan(fingerprint=fp, llamacpp=llamacpp, created_at=str(doc.get("created_at", "")), gemm=gemm,
                engines=engines, thread_waits=waits)


def differences(plan_fp: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    return [f"{k}: plan {plan_fp.get(k, '(none)')!r}, here {here.get(k, '(none)')!r}"
            for k in sorted(set(plan_fp) | set(here)) if plan_fp.get(k) != here.get(k)]


def read(path: str | Path) -> Plan:
    """Read and parse a plan file, checking no fingerprint."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanRefused(f"cannot read {path}: {e.strerror or e}") from None
    return parse(text, str(path))


def load(path: str | Path, fingerprint: Mapping[str, str]) -> Plan:
    """Read and check a plan. PlanRefused names what is wrong (the differing fingerprint fields)."""
    path = Path(path)
    plan = read(path)
    diff = differences(plan.fingerprint, fingerprint)
    if diff:
        raise PlanRefused(f"{path} was tuned for another machine or build: " + "; ".join(diff))
    return plan


def save(plan: Plan, path: str | Path) -> None:
    """Write atomically: a reader sees the old plan or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(plan.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def misses_path(path: str | Path) -> Path:
    return Path(str(path) + ".misses.json")


def record_miss(path: str | Path, key: Mapping[str, Any]) -> None:
    """Remember a key the plan lacked, for the next `tune` (deduplicated; best effort)."""
    target = misses_path(path)
    try:
        known = json.loads(target.read_text()) if target.exists() else []
        if dict(key) not in known:
            known.append(dict(key))
            target.parent.mkdir(parents=True, exist_ok=True)   # a first start: no data dir yet
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            os.replace(tmp, target)
    except (OSError, ValueError) as e:
        log.warning("tuned plan: cannot record the missed key in %s: %s", target, e)


def clear_misses(path: str | Path, model: str) -> None:
    """Forget the recorded misses of a model that has just been tuned."""
    _keep_misses(path, lambda m: m.get("model") != model)


def clear_gemm_misses(path: str | Path, covered: Sequence[Mapping[str, Any]]) -> None:
    """Forget the recorded GEMM misses that `tune --gemm` has just measured."""
    done = [dict(c) for c in covered]
    _keep_misses(path, lambda m: m not in done)


def _keep_misses(path: str | Path, keep: Any) -> None:
    target = misses_path(path)
    left = [m for m in read_misses(path) if keep(m)]
    try:
        if left:
            target.write_text(json.dumps(left, indent=1, sort_keys=True))
        else:
            target.unlink(missing_ok=True)
    except OSError as e:
        log.warning("tuned plan: cannot update %s: %s", target, e)


def read_misses(path: str | Path) -> list[dict[str, Any]]:
    try:
        found = json.loads(misses_path(path).read_text())
        return [m for m in found if isinstance(m, dict)]
    except (OSError, ValueError):
        return []


def gemm_misses(path: str | Path) -> list[dict[str, Any]]:
    """The recorded misses of GEMM shapes (those with an "op"), in the order they were met."""
    return [m for m in read_misses(path) if "op" in m]


def record_gemm_misses(path: str | Path, table: Any) -> int:
    """Write the (key, bucket) pairs `table` missed since the last call to the misses file;
    the count. `table` is a `kernels.plan.GemmTable`."""
    missed = table.drain_misses()
    for key, bucket in missed:
        record_miss(path, key.miss(bucket))
    return len(missed)


def load_gemm(path: str | Path, fingerprint: Mapping[str, str]) -> Any:
    """The plan's GEMM table (`kernels.plan.GemmTable`), only when its gemm fingerprint equals
    `fingerprint` field for field; else PlanRefused naming the fields that differ, or the bad
    entry. The llama.cpp part of the file does not matter here, beyond the file parsing."""
    return gemm_table(read(path), fingerprint, str(path))


def gemm_table(plan: Plan, fingerprint: Mapping[str, str], source: str = "plan") -> Any:
    """`load_gemm` on a plan already read."""
    from kernels.plan import GemmTable   # torch: only the torch runner and `tune --gemm` get here

    if plan.gemm is None:
        raise PlanRefused(f"{source} has no GEMM entries (no gemm section)")
    diff = differences({str(k): str(v) for k, v in plan.gemm["fingerprint"].items()}, fingerprint)
    if diff:
        raise PlanRefused(f"{source}'s GEMM entries were tuned for another GPU or build: " + "; ".join(diff))
    try:
        return GemmTable.from_json(plan.gemm)
    except ValueError as e:
        raise PlanRefused(f"{source}'s gemm section is malformed ({e})") from None


def resolve_gemm(path: str | Path | None, fingerprint: Mapping[str, str], explicit: bool = False) -> tuple[Any, Resolved]:
    """The runner's GEMM table and what happened. Always a table: the plan's when usable, else
    an empty one under `fingerprint`, whose lookups all miss (DEFAULT) and are recorded all the
    same, so the first `tune --gemm` knows what to measure. A refusal is logged with its reason."""
    from kernels.plan import GemmTable

    empty = GemmTable(fingerprint)
    if path is None:
        return empty, Resolved("off")
    path = Path(path)
    if not path.exists():
        return empty, Resolved("absent", str(path), reason="no plan file")
    try:
        plan = read(path)
        table = gemm_table(plan, fingerprint, str(path))
    except PlanRefused as e:
        log.log(logging.ERROR if explicit else logging.WARNING, "tuned GEMM plan refused: %s", e)
        return empty, Resolved("refused", str(path), reason=str(e))
    log.info("tuned GEMM plan %s (%s): %d shapes", path, plan.hash, len(table.entries))
    return table, Resolved("used", str(path), plan.hash, choice={"gemm_shapes": len(table.entries)})


@dataclass(frozen=True)
class Resolved:
    """What the engine did with the plan at start: reported in /health and stored with runs."""

    status: str                     # used, miss, refused, absent, off
    path: str = ""
    hash: str = ""
    reason: str = ""
    choice: Mapping[str, Any] = field(default_factory=dict)
    misses: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "path": self.path, "hash": self.hash, "reason": self.reason,
                "choice": dict(self.choice), "misses": self.misses}


def resolve(path: str | Path | None, explicit: bool, fingerprint: Mapping[str, str], model: str,
            depth: int) -> tuple[LlamaCppChoice | None, Resolved]:
    """The choice for this model at this working depth, and what happened. A plan named
    explicitly that cannot be used is logged as an error; the default location's, as a warning."""
    if path is None:
        return None, Resolved("off")
    path = Path(path)
    if not path.exists():
        if explicit:
            log.error("tuned plan %s does not exist; using the fixed defaults", path)
        return None, Resolved("absent", str(path), reason="no plan file")
    try:
        plan = load(path, fingerprint)
    except PlanRefused as e:
        log.log(logging.ERROR if explicit else logging.WARNING, "tuned plan refused: %s", e)
        return None, Resolved("refused", str(path), reason=str(e))
    choice = plan.lookup(model, depth)
    if choice is None:
        key = {"backend": "llama.cpp", "model": model, "depth": depth}
        record_miss(path, key)
        log.warning("tuned plan %s has no entry for model %s; using the fixed defaults (recorded for "
                    "the next `appliance tune`)", path, model)
        return None, Resolved("miss", str(path), plan.hash, reason=f"no entry for model {model}", misses=1)
    log.info("tuned plan %s (%s): %s", path, plan.hash, choice.settings)
    return choice, Resolved("used", str(path), plan.hash, choice=choice.settings.as_dict())


def apply(cfg: EngineConfig, model_path: Path) -> tuple[EngineConfig, Resolved]:
    """Fill the llama.cpp settings left at their defaults from the tuned plan's entry for this
    model at the working depth (half the context: llama.cpp fixes these per context, so one
    entry is used for the whole run). Flags and environment variables that set them win."""
    path, explicit = cfg.resolved_plan()
    if path is None:
        return cfg, Resolved("off")
    if cfg.engine != "llamacpp":  # the plan holds llama.cpp settings only, for now
        return cfg, Resolved("off", reason=f"the plan has no entries for --engine {cfg.engine}")
    fingerprint = current_fingerprint(llama_cpp_build())
    depth = (cfg.n_ctx or 8192) // 2
    choice, resolved = resolve(path, explicit, fingerprint, file_fingerprint(model_path), depth)
    if choice is None:
        return cfg, resolved
    return fill_defaults(cfg, choice.settings), resolved


def fill_defaults(cfg: EngineConfig, chosen: LlamaCppSettings) -> EngineConfig:
    """cfg with each llama.cpp setting it leaves at the default taken from `chosen`; n_batch is
    raised to the prefill chunk if below it (a prompt chunk must fit one llama_decode)."""
    defaults = EngineConfig()
    merged = {k: v if getattr(cfg, k) == getattr(defaults, k) else getattr(cfg, k)
              for k, v in chosen.as_dict().items()}
    merged["n_batch"] = max(merged["n_batch"], cfg.prefill_chunk)
    return cfg.with_llamacpp(LlamaCppSettings(**merged))
