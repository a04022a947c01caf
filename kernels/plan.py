"""The GEMM half of the tuned plan: which `wgemm` configuration to launch for a shape, measured
offline by `appliance tune --gemm` on the GPU that will serve, read by the runner at start. The
server never autotunes: a lookup is a pure function of the table and the shape.

Keys and buckets. A configuration is chosen per key (op, weight format, N, K) and per batch
bucket of M (`BUCKETS`): 1-16 (decode steps, speculative verify rows), 17-64, 65-256 and 257+
(prompt chunks). `bucket(m)` is a pure, total function of M >= 1, so one shape at one batch
size always launches the same kernel.

Exactness rule. Within one key every bucket's configuration has the same block_k, split_k and
dot type. Those three fix how a row's K products are rounded and in which order they are
summed, so a row of y does not depend on how many other rows share the launch: a one-token
decode step and the same row inside a k-row verify agree bit for bit, which speculative
decoding and the prompt cache need. `GemmTable` refuses a table that breaks the rule. The other
fields (block_m, block_n, warps, stages) only decide which program computes a tile, but a tile
shape can still change the instruction behind `tl.dot` (on Hopper, wgmma for 64-row tiles,
mma.sync for 16-row ones; under the interpreter numpy's BLAS picks kernels by shape), so the
search also checks, bit for bit, that each bucket's candidate reproduces the decode winner's
rows before it may be timed.

How the search keeps the rule: decode first. The smallest bucket searched (normally 1-16)
picks from every candidate; its winner fixes (block_k, split_k, dot), and each larger bucket
then searches the candidates with that triple substituted, the decode winner itself first
(it is batch-invariant by construction, so every bucket has at least one passing candidate).
Why decode decides: decode GEMMs run once per generated token, are memory-bound with few
programs (N / block_n), and are exactly where block_k and split-K matter; prompt-sized
launches have tiles enough to fill the GPU and are shaped mostly by block_m/block_n/warps/
stages. Minimising a summed time instead would let the long prompt launches outvote the
per-token cost, and it needs every pair timed in every bucket.

Checked before timed (gemm_trial.py). A candidate runs once on random activations and a
random weight quantized by the format's own quantizer; its output is compared with
`wgemm_torch` (max |y - ref| / max |ref| within `TOLERANCE` of its dot type). One that fails,
raises (too much shared memory, say) or breaks row invariance is dropped with its reason and
never timed. The rest are timed (median of repeats: CUDA events with L2 flushed before each
repeat on a GPU, perf_counter on CPU, where interpreter timings say nothing about speed); the
fastest wins, and one within `NEAR_TIE` of it that comes earlier in the candidate list wins
instead.

Misses. A key the table lacks launches `wgemm.DEFAULT` (one config for every bucket, so the
rule holds); a bucket missing from a key it holds takes the nearest bucket's config (same
reduction). Either way the lookup reports hit=False and remembers (key, bucket) in `misses`,
which the engine writes to the plan's misses file for the next `tune`.

File form (the "gemm" section of the plan file):

    {"fingerprint": {"device": "NVIDIA H200", "capability": "9.0", "runtime": "cuda 12.8", ...},
     "entries": [{"op": "wgemm", "fmt": "q4_0", "n": 4096, "k": 4096, "bucket": "1-16",
                  "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 2, "num_warps": 4,
                  "num_stages": 3, "dot": "bf16", "median_us": 21.4, "checked_vs_ref": true,
                  "max_rel_err": 0.0031}, ...]}

This module imports nothing from `appliance`; it imports torch (through `wgemm`), so the
engine's plan module keeps the section as plain JSON and builds the table only for the runner.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ._triton import INTERPRET, triton
from .formats import format_of
from .gemm_trial import TOLERANCE, RunFn, TimeFn, Trial, candidates, check, quantized_weight, timer
from .wgemm import DEFAULT, DOT_TYPES, GemmConfig, wgemm

OPS = ("wgemm",)
BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("1-16", 1, 16), ("17-64", 17, 64), ("65-256", 65, 256), ("257+", 257, math.inf))
BUCKET_NAMES = tuple(name for name, _, _ in BUCKETS)
# the M each bucket is measured at on a GPU: its top (the prompt bucket: the default prefill chunk)
BUCKET_M = {"1-16": 16, "17-64": 64, "65-256": 256, "257+": 512}
# under the interpreter: each bucket's smallest M, so a test's search takes seconds
BUCKET_M_SMALL = {name: lo for name, lo, _ in BUCKETS}
NEAR_TIE = 0.02
CONFIG_FIELDS = tuple(f.name for f in fields(GemmConfig))
_KEY_FIELDS = ("op", "fmt", "n", "k", "bucket")
_MEASURED_FIELDS = ("median_us", "checked_vs_ref", "max_rel_err")


def bucket(m: int) -> str:
    """The batch bucket of M rows: a pure function, total over M >= 1."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"M must be an integer >= 1, not {m!r}")
    return next(name for name, lo, hi in BUCKETS if lo <= m <= hi)


@dataclass(frozen=True, order=True)
class GemmKey:
    op: str
    fmt: str
    n: int
    k: int

    @property
    def label(self) -> str:
        return f"{self.op} {self.fmt} N={self.n} K={self.k}"

    def miss(self, bucket_name: str) -> dict[str, Any]:
        """The key as the plan's misses file records it."""
        return {"op": self.op, "fmt": self.fmt, "n": self.n, "k": self.k, "bucket": bucket_name}

    @classmethod
    def of(cls, op: str, fmt, n: int, k: int) -> GemmKey:
        """A checked key: a known op and format, N >= 1, K >= 1 in whole blocks."""
        f = format_of(fmt)
        if op not in OPS:
            raise ValueError(f"unknown GEMM op {op!r} (known: {', '.join(OPS)})")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (n, k)) or k % f.block:
            raise ValueError(f"N and K must be integers >= 1, K a multiple of {f.name}'s {f.block}; "
                             f"got N={n!r} K={k!r}")
        return cls(op, f.name, n, k)


@dataclass(frozen=True)
class GemmEntry:
    """One bucket's winner and what it was chosen on."""
    config: GemmConfig
    median_us: float
    max_rel_err: float
    checked_vs_ref: bool = True

    def to_json(self) -> dict[str, Any]:
        return {**self.config.as_dict(), "median_us": self.median_us, "checked_vs_ref": self.checked_vs_ref,
                "max_rel_err": self.max_rel_err}


def _reduction(c: GemmConfig) -> tuple[int, int, str]:
    """What fixes a row's arithmetic: shared by every bucket of a key."""
    return c.block_k, c.split_k, c.dot


@dataclass(frozen=True)
class GemmTable:
    """{key: {bucket: entry}} under the fingerprint of the GPU and software it was measured on.
    Equality ignores `misses`, the lookups' running record."""
    fingerprint: Mapping[str, str]
    entries: Mapping[GemmKey, Mapping[str, GemmEntry]] = field(default_factory=dict)
    misses: set = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self):
        norm = {}
        for key, per in sorted(self.entries.items()):
            fmt = format_of(key.fmt)
            for b, e in per.items():
                if b not in BUCKET_NAMES:
                    raise ValueError(f"{key.label}: unknown bucket {b!r} (known: {', '.join(BUCKET_NAMES)})")
                e.config.check(fmt)
            if len({_reduction(e.config) for e in per.values()}) > 1:
                raise ValueError(f"{key.label}: its buckets disagree on block_k/split_k/dot "
                                 f"({sorted({_reduction(e.config) for e in per.values()})}); a row's result "
                                 f"would depend on the batch")
            if per:                 # a key without buckets is no entry (and would not round-trip)
                norm[key] = {b: per[b] for b in BUCKET_NAMES if b in per}
        object.__setattr__(self, "fingerprint", {str(k): str(v) for k, v in self.fingerprint.items()})
        object.__setattr__(self, "entries", norm)

    def lookup(self, op: str, fmt, n: int, k: int, m: int) -> tuple[GemmConfig, bool]:
        """The config for this shape at M rows and whether the table held it. A miss returns
        `wgemm.DEFAULT` (an unknown key) or the nearest bucket's config (a known key lacking
        this bucket: the same reduction) and is remembered in `misses`."""
        key, b = GemmKey(op, format_of(fmt).name, n, k), bucket(m)
        per = self.entries.get(key)
        if per and b in per:
            return per[b].config, True
        self.misses.add((key, b))
        if not per:
            return DEFAULT, False
        i = BUCKET_NAMES.index(b)
        nearest = min(per, key=lambda other: (abs(BUCKET_NAMES.index(other) - i), BUCKET_NAMES.index(other)))
        return per[nearest].config, False

    def drain_misses(self) -> list[tuple[GemmKey, str]]:
        """The (key, bucket) pairs missed since the last drain, in a fixed order; forgets them."""
        out = sorted(self.misses, key=lambda kb: (kb[0], BUCKET_NAMES.index(kb[1])))
        self.misses.clear()
        return out

    def merged(self, found: Mapping[GemmKey, Mapping[str, GemmEntry]]) -> GemmTable:
        """A new table with each key in `found` replaced whole (its buckets were searched
        together, sharing one reduction)."""
        return GemmTable(self.fingerprint, {**self.entries, **{k: v for k, v in found.items() if v}})

    def to_json(self) -> dict[str, Any]:
        """The plan file's "gemm" section, JSON-ready: entries in key then bucket order."""
        rows = [{**{"op": key.op, "fmt": key.fmt, "n": key.n, "k": key.k, "bucket": b}, **e.to_json()}
                for key, per in self.entries.items() for b, e in per.items()]
        return {"fingerprint": dict(self.fingerprint), "entries": rows}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any] | str) -> GemmTable:
        """The table from a "gemm" section (or its JSON text). ValueError names a bad entry;
        unknown fields are refused too (a misspelt one would otherwise pass silently)."""
        if isinstance(doc, str):
            doc = json.loads(doc)
        if not isinstance(doc, Mapping) or set(doc) != {"fingerprint", "entries"}:
            raise ValueError('a gemm section is {"fingerprint": {...}, "entries": [...]}')
        fp, rows = doc["fingerprint"], doc["entries"]
        if not isinstance(fp, Mapping) or not all(isinstance(v, str) for v in fp.values()):
            raise ValueError("the gemm fingerprint must map names to strings")
        if not isinstance(rows, list):
            raise ValueError("the gemm entries must be a list")
        table: dict[GemmKey, dict[str, GemmEntry]] = {}
        for i, row in enumerate(rows):
            key, b, entry = _entry_from_json(i, row)
            if b in table.setdefault(key, {}):
                raise ValueError(f"gemm entry {i} ({key.label} bucket {b}) repeats an earlier one")
            table[key][b] = entry
        return cls(fp, table)


def _entry_from_json(i: int, row: Any) -> tuple[GemmKey, str, GemmEntry]:
    where = f"gemm entry {i}"
    try:
        if not isinstance(row, Mapping):
            raise ValueError("not an object")
        where += f" ({row.get('op')} {row.get('fmt')} N={row.get('n')} K={row.get('k')} bucket {row.get('bucket')})"
        want = set(_KEY_FIELDS) | set(CONFIG_FIELDS) | set(_MEASURED_FIELDS)
        if set(row) != want:
            raise ValueError(f"fields missing {sorted(want - set(row))}, unknown {sorted(set(row) - want)}")
        key = GemmKey.of(row["op"], row["fmt"], row["n"], row["k"])
        if row["bucket"] not in BUCKET_NAMES:
            raise ValueError(f"unknown bucket (known: {', '.join(BUCKET_NAMES)})")
        cfg = _config(row)
        cfg.check(format_of(key.fmt))
        if row["checked_vs_ref"] is not True:
            raise ValueError("checked_vs_ref must be true: an unchecked config is never launched")
        us, err = row["median_us"], row["max_rel_err"]
        if not all(_number(v) for v in (us, err)):
            raise ValueError("median_us and max_rel_err must be finite numbers >= 0")
        if err > TOLERANCE[cfg.dot]:
            raise ValueError(f"max_rel_err {err} is over the {cfg.dot} bound {TOLERANCE[cfg.dot]}")
        return key, row["bucket"], GemmEntry(cfg, float(us), float(err))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _config(row: Mapping[str, Any]) -> GemmConfig:
    ints = [f for f in CONFIG_FIELDS if f != "dot"]
    if not all(isinstance(row[f], int) and not isinstance(row[f], bool) for f in ints):
        raise ValueError(f"{', '.join(ints)} must be integers")
    if row["num_warps"] not in (1, 2, 4, 8, 16, 32) or row["num_stages"] < 1 or row["dot"] not in DOT_TYPES:
        raise ValueError(f"num_warps a power of two up to 32, num_stages >= 1, dot in {DOT_TYPES}")
    return GemmConfig(**{f: row[f] for f in CONFIG_FIELDS})


# ------------------------------------------------------------------------- fingerprint

def kernel_sources_hash() -> str:
    """sha256 over kernels/*.py: a kernel (or search) change invalidates every entry."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def gemm_fingerprint(device: str | torch.device = "cuda") -> dict[str, str]:
    """What the measurements depend on: the GPU (name, compute capability), the CUDA/HIP
    runtime and the driver, torch, Triton and the kernels' sources. On CPU (the interpreter,
    for tests) the device fields say "cpu" / "interpreter"."""
    dev = torch.device(device)
    common = {"torch": str(torch.__version__), "triton": getattr(triton, "__version__", "absent"),
              "kernel_sources": kernel_sources_hash()}
    if dev.type != "cuda":
        mode = "interpreter" if INTERPRET else "none"
        return {"device": "cpu", "capability": mode, "runtime": mode, "driver": "none", **common}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    runtime = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
    return {"device": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "runtime": runtime, "driver": _driver_version(), **common}


def _driver_version() -> str:
    """The driver's version string from NVML when it is installed, else the CUDA version the
    driver supports (what torch exposes), else "unknown"."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML absent or failing: fall back
        pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        return f"cuda-driver-api {get()}" if get else "unknown"
    except RuntimeError:
        return "unknown"


# ------------------------------------------------------------------------------ search

@dataclass(frozen=True)
class Dropped:
    bucket: str
    config: GemmConfig
    reason: str


@dataclass
class SearchResult:
    """One key's search: the winners by bucket, every timing, every dropped candidate."""
    key: GemmKey
    entries: dict[str, GemmEntry] = field(default_factory=dict)
    timed: list[tuple[str, GemmConfig, float]] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)


def search(op: str, fmt, n: int, k: int, buckets_m: Mapping[str, int] | None = None,
           cands: Iterable[GemmConfig] | None = None, time_fn: TimeFn | None = None,
           device: str | torch.device = "cuda", run_fn: RunFn | None = None, seed: int = 0) -> SearchResult:
    """Search one key over the buckets in `buckets_m` (bucket -> the M it is measured at),
    decode first (see the module's docstring): check each candidate against `wgemm_torch`, time
    the ones that pass, keep the winners. `run_fn` (default `wgemm`) and `time_fn` (default
    `timer(device)`) are hooks for tests."""
    key, f = GemmKey.of(op, fmt, n, k), format_of(fmt)
    buckets_m = dict(BUCKET_M if buckets_m is None else buckets_m)
    for b, m in buckets_m.items():
        if b not in BUCKET_NAMES or bucket(m) != b:
            raise ValueError(f"bucket {b!r} cannot be measured at M={m!r}")
    order = [b for b in BUCKET_NAMES if b in buckets_m]
    cands = list(candidates(f) if cands is None else cands)
    ctx = Trial(f, k, quantized_weight(f, n, k, seed).to(device), device, run_fn or wgemm,
                   time_fn or timer(device), max(buckets_m.values(), default=1), seed)
    result = SearchResult(key)
    if not order:
        return result
    first = order[0]
    win = _search_bucket(ctx, result, first, buckets_m[first], cands, rows=None)
    if win is None:
        return result
    bk, sk, dot = _reduction(win.config)
    rows = (buckets_m[first], ctx.run(ctx.x(buckets_m[first], dot), win.config))
    for b in order[1:]:
        same = _unique([win.config] + [replace(c, block_k=bk, split_k=sk, dot=dot) for c in cands])
        _search_bucket(ctx, result, b, buckets_m[b], same, rows)
    return result


def _unique(configs: list[GemmConfig]) -> list[GemmConfig]:
    return list(dict.fromkeys(configs))


def _search_bucket(ctx: Trial, result: SearchResult, b: str, m: int, cands: list[GemmConfig],
                   rows) -> GemmEntry | None:
    """Check, then time, the candidates that fit M (block_m no larger than M's power of two,
    16 at least); the winner goes into result.entries[b]."""
    fit = 1 << max(4, (m - 1).bit_length())
    passed = []
    for cfg in (c for c in cands if c.block_m <= fit):
        reason, err = check(ctx, m, cfg, rows)
        if reason:
            result.dropped.append(Dropped(b, cfg, reason))
            continue
        x = ctx.x(m, cfg.dot)
        us = float(ctx.time_fn(lambda x=x, cfg=cfg: ctx.run(x, cfg), cfg, m))
        result.timed.append((b, cfg, us))
        passed.append((cfg, us, err))
    if not passed:
        return None
    best = min(us for _, us, _ in passed)
    cfg, us, err = next(p for p in passed if p[1] <= best * (1 + NEAR_TIE))
    result.entries[b] = GemmEntry(cfg, round(us, 3), err)
    return result.entries[b]


__all__ = ["BUCKETS", "BUCKET_M", "BUCKET_M_SMALL", "BUCKET_NAMES", "NEAR_TIE", "Dropped", "GemmEntry", "GemmKey",
           "GemmTable", "SearchResult", "bucket", "gemm_fingerprint", "kernel_sources_hash", "search"]
