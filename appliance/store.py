"""The result store: bench and sweep runs, their host snapshots and their measured cells, in one
SQLite file written through sqlite-utils.

Schema, built by named migrations that are applied once each and recorded in `_migrations`:

    runs            one bench or sweep invocation: command line (JSON argv), engine settings
                    (JSON), model fingerprint (file name, sha256, quant, size), appliance
                    version, started/finished times (UTC ISO 8601), status, and the process
                    that writes it (`run_owner.Owner`: host, boot, pid namespace, pid, start time)
    host_snapshots  one per run (run_id is the key): the host snapshot and the sampler's
                    per-phase figures (median power and clocks for prefill and decode), as JSON
    results         one measured cell per row (`ResultCell`'s fields, joules and cap included)

Durability and concurrency: WAL journal, a busy timeout on every connection, and every write in
one `BEGIN IMMEDIATE` transaction (a whole batch of cells at once). A bench killed at any moment
leaves only whole batches; a reader with its own connection reads the last committed state while
a writer writes and never sees "database is locked". A `Store` is one connection: use it from
one thread, and open another `Store` to read from another thread or process.

A run killed with kill -9 (or by a power cut) stays 'running' in the file. Readers report a
running run whose process is gone (`Owner.gone`) as interrupted, and `Store.open` records it so:
a read-only reader (the web page's) never writes, and what a writable open records is what every
other reader sees, a copy of the file on another host included.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sqlite3
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import sqlite_utils

from . import __version__
from .run_owner import Owner

BUSY_TIMEOUT_MS = 10_000


class UnknownRun(LookupError):
    """No run with this id in the database."""

    def __init__(self, run_id: int) -> None:
        super().__init__(f"no run with id {run_id}")
        self.run_id = run_id


class RunStatus(StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the weights a run measured, wherever the file lives."""

    name: str        # the file name
    sha256: str      # hex digest of the whole file
    quant: str       # the GGUF's general.file_type as llama.cpp names it (Q4_1, Q4_K_M, F16) or "unknown"
    size_bytes: int


@dataclass(frozen=True)
class RunInfo:
    id: int
    kind: str                         # bench or sweep
    command: tuple[str, ...]
    engine_settings: dict[str, Any]
    model: ModelFingerprint
    appliance_version: str
    started_at: str
    finished_at: str | None
    status: RunStatus
    note: str = ""                    # what an incomplete run is missing, and why


@dataclass(frozen=True)
class ResultCell:
    """One measured cell: a figure with all of its conditions (shared/BENCHMARKING.md, rule 1).
    Rates are tokens per second; a rate that the cell cannot define (no decode after the first
    token, no engine timings) is None."""

    mode: str                         # serial, lookup, draft
    prompt_set: str                   # the named set the prompt came from
    depth: int                        # context positions filled when decoding starts
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tps: float | None         # prompt tokens / TTFT, for an uncached request
    client_decode_tps: float | None   # content tokens / (last token time - first token time)
    engine_decode_tps: float | None   # what the scheduler timed inside its batches
    tokens_per_step: float | None     # tokens committed per verification step (1.0 serial)
    concurrency: int = 1
    repeat_index: int = 0
    cache_on: bool = False
    cached_tokens: int = 0
    kind: str = "sweep"               # what the cell measures: sweep, prompt, concurrency, agent, needle
    target: str = "served"            # served (through the HTTP API) or raw (llama.cpp in-process)
    variant: str = ""                 # the A/B label ("A", "B") of an A/B run, else ""
    engine_prefill_tps: float | None = None   # the engine's own prompt rate (timings.prompt_per_second)
    extra: Mapping[str, Any] = field(default_factory=dict)  # kind-specific figures, JSON
    # Joules, gross, over each span (prefill: send to first token; decode: to the end; request:
    # both, or a raw/concurrent cell's share of its batch); None with energy_note saying why.
    prefill_j: float | None = None
    prefill_s: float | None = None
    decode_j: float | None = None
    decode_s: float | None = None
    request_j: float | None = None
    request_s: float | None = None
    energy_note: str = ""
    power_cap_w: float | None = None  # the cap a `bench --power-cap` cell ran under, else None

    @property
    def prefill_tpj(self) -> float | None:   # prompt tokens per joule: rate / the span's mean power
        ok = self.prefill_tps is not None and self.prefill_s and self.prefill_j and self.prefill_j > 0
        return self.prefill_tps * self.prefill_s / self.prefill_j if ok else None  # type: ignore[operator]

    @property
    def decode_tpj(self) -> float | None:    # generated tokens per joule, likewise
        ok = self.client_decode_tps is not None and self.decode_s and self.decode_j and self.decode_j > 0
        return self.client_decode_tps * self.decode_s / self.decode_j if ok else None  # type: ignore[operator]

    def __post_init__(self) -> None:
        if not self.mode or not self.prompt_set or not self.kind or not self.target:
            raise ValueError("mode, prompt_set, kind and target must not be empty")
        counts = (self.depth, self.prompt_tokens, self.generated_tokens, self.repeat_index,
                  self.cached_tokens)
        if min(counts) < 0 or self.concurrency < 1 or self.ttft_ms < 0:
            raise ValueError(f"negative count, time or concurrency in {self}")


@dataclass(frozen=True)
class HostRecord:
    run_id: int
    recorded_at: str
    snapshot: dict[str, Any]
    phases: dict[str, Any]


class _Migrations(sqlite_utils.Migrations):
    migrations_table = "_migrations"


MIGRATIONS = _Migrations("appliance")


@MIGRATIONS(name="0001_runs_host_snapshots_results")
def _create_tables(db: sqlite_utils.Database) -> None:
    # Columns are spelled out here, not derived from the dataclasses: a migration describes the
    # schema as it was when it was written. Later changes are new migrations.
    db.table("runs").create({
        "id": int, "started_at": str, "finished_at": str, "status": str, "command": str,
        "engine_settings": str, "model_name": str, "model_sha256": str, "model_quant": str,
        "model_size_bytes": int, "appliance_version": str,
    }, pk="id", not_null={"started_at", "status", "command", "engine_settings", "model_name",
                          "model_sha256", "model_quant", "model_size_bytes", "appliance_version"})
    db.table("host_snapshots").create(
        {"run_id": int, "recorded_at": str, "snapshot": str, "phases": str},
        pk="run_id", foreign_keys=[("run_id", "runs", "id")],
        not_null={"recorded_at", "snapshot", "phases"})
    db.table("results").create({
        "id": int, "run_id": int, "mode": str, "prompt_set": str, "depth": int,
        "prompt_tokens": int, "generated_tokens": int, "ttft_ms": float, "prefill_tps": float,
        "client_decode_tps": float, "engine_decode_tps": float, "tokens_per_step": float,
        "concurrency": int, "repeat_index": int, "cache_on": int, "cached_tokens": int,
    }, pk="id", foreign_keys=[("run_id", "runs", "id")],
        not_null={"run_id", "mode", "prompt_set", "depth", "prompt_tokens", "generated_tokens",
                  "ttft_ms", "concurrency", "repeat_index", "cache_on", "cached_tokens"})
    db.table("results").create_index(["run_id"])


@MIGRATIONS(name="0002_cell_kind_target_variant_extra")
def _cell_kinds(db: sqlite_utils.Database) -> None:
    # Rows written before this migration were all served sweep cells without A/B labels.
    results = db.table("results")
    results.add_column("kind", str, not_null_default="sweep")
    results.add_column("target", str, not_null_default="served")
    results.add_column("variant", str, not_null_default="")
    results.add_column("engine_prefill_tps", float)
    results.add_column("extra", str, not_null_default="{}")
    runs = db.table("runs")
    runs.add_column("kind", str, not_null_default="bench")
    runs.add_column("note", str, not_null_default="")


_OWNER_COLUMNS = {"owner_host": str, "owner_boot": str, "owner_pidns": str, "owner_pid": int, "owner_start": int}


@MIGRATIONS(name="0003_run_owner")
def _run_owner(db: sqlite_utils.Database) -> None:
    # Runs written before this migration have no owner: they are never judged gone.
    for name, kind in _OWNER_COLUMNS.items():
        db.table("runs").add_column(name, kind)


@MIGRATIONS(name="0004_cell_energy_power_cap")
def _cell_energy(db: sqlite_utils.Database) -> None:   # older cells measured no energy: the note says so
    for name in ("prefill_j", "prefill_s", "decode_j", "decode_s", "request_j", "request_s", "power_cap_w"):
        db.table("results").add_column(name, float)
    db.table("results").add_column("energy_note", str, not_null_default="")
    db.execute("UPDATE results SET energy_note = 'stored before energy was measured'")


class Store:
    """Runs, host snapshots and results in one SQLite file. Open with `Store.open(path)`."""

    def __init__(self, db: sqlite_utils.Database, path: Path) -> None:
        self._db = db
        self.path = path
        self._me = Owner.current()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Store:
        """Open (creating it and its directory if needed) and bring the schema up to date."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000)
        # Before anything else touches the file: every lock this connection meets is waited for.
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        db = sqlite_utils.Database(conn, execute_plugins=False)
        db.execute("PRAGMA foreign_keys=ON")
        db.enable_wal()
        store = cls(db, path)
        store._migrate()
        store._interrupt_gone()
        return store

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db(self) -> sqlite_utils.Database:
        """The underlying sqlite-utils database, for reports and ad-hoc queries."""
        return self._db

    # -- writers ---------------------------------------------------------------------------

    def start_run(self, command: Sequence[str], engine_settings: Mapping[str, Any],
                  model: ModelFingerprint, appliance_version: str = __version__,
                  kind: str = "bench") -> int:
        """Record a new run with status 'running', owned by this process; returns its id."""
        owner = {f"owner_{k}": v for k, v in asdict(self._me).items()} if self._me else {}
        row = {"kind": kind, "note": "", "started_at": _now(), "finished_at": None, "status": RunStatus.RUNNING.value,
               "command": json.dumps(list(command)),
               "engine_settings": json.dumps(dict(engine_settings), sort_keys=True),
               "model_name": model.name, "model_sha256": model.sha256, "model_quant": model.quant,
               "model_size_bytes": model.size_bytes, "appliance_version": appliance_version, **owner}
        with self._write():
            run_id = self._db.table("runs").insert(row).last_pk
        return int(run_id)

    def add_cells(self, run_id: int, cells: Iterable[ResultCell]) -> int:
        """Append a batch of cells in one transaction: all of them are stored, or none."""
        rows = [{"run_id": run_id, **_cell_row(cell)} for cell in cells]
        if rows:
            with self._write():
                self._require_run(run_id)
                self._db.table("results").insert_all(rows)
        return len(rows)

    def finish_run(self, run_id: int, status: RunStatus | str, note: str = "") -> None:
        """Close the run; `note` says what an incomplete run is missing and why."""
        status = RunStatus(status)
        if status is RunStatus.RUNNING:
            raise ValueError("finish_run needs a final status, not 'running'")
        with self._write():
            self._require_run(run_id)
            self._db.table("runs").update(run_id, {"status": status.value, "finished_at": _now(),
                                                   "note": note})

    def record_host(self, run_id: int, snapshot: Mapping[str, Any],
                    phases: Mapping[str, Any]) -> None:
        """Store the run's host snapshot and per-phase figures, replacing any earlier ones."""
        row = {"run_id": run_id, "recorded_at": _now(),
               "snapshot": json.dumps(dict(snapshot), sort_keys=True),
               "phases": json.dumps(dict(phases), sort_keys=True)}
        with self._write():
            self._require_run(run_id)
            self._db.table("host_snapshots").insert(row, replace=True)

    # -- readers ---------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        return [self._info(r) for r in self._db.table("runs").rows_where(order_by="id")]

    def run(self, run_id: int) -> RunInfo:
        rows = list(self._db.table("runs").rows_where("id = ?", [run_id]))
        if not rows:
            raise UnknownRun(run_id)
        return self._info(rows[0])

    def last_run(self) -> RunInfo | None:
        rows = list(self._db.table("runs").rows_where(order_by="id desc", limit=1))
        return self._info(rows[0]) if rows else None

    def results(self, run_id: int) -> list[ResultCell]:
        """The run's cells in the order they were added."""
        rows = self._db.table("results").rows_where("run_id = ?", [run_id], order_by="id")
        return [_cell(r) for r in rows]

    def host(self, run_id: int) -> HostRecord | None:
        rows = list(self._db.table("host_snapshots").rows_where("run_id = ?", [run_id]))
        if not rows:
            return None
        r = rows[0]
        return HostRecord(run_id=r["run_id"], recorded_at=r["recorded_at"],
                          snapshot=json.loads(r["snapshot"]), phases=json.loads(r["phases"]))

    # -- internals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction. IMMEDIATE takes the write lock up front, waiting for another writer
        up to the busy timeout, so a transaction never fails half-way on a lock upgrade.
        sqlite-utils' own atomic blocks nest inside as savepoints."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._db.rollback()
            raise

    def _migrate(self) -> None:
        # Check without the write lock first, so readers of an up-to-date file never take it;
        # apply() checks again under the lock, so concurrent openers apply each migration once.
        if MIGRATIONS.pending(self._db):
            with self._write():
                MIGRATIONS.apply(self._db)

    def _gone(self, row: Mapping[str, Any]) -> str | None:
        """Why a running run's process is known to be gone (`Owner.gone`), else None."""
        if row["status"] != RunStatus.RUNNING or row["owner_pid"] is None or self._me is None:
            return None
        return Owner(**{k.removeprefix("owner_"): row[k] for k in _OWNER_COLUMNS}).gone(self._me)

    def _info(self, row: Mapping[str, Any]) -> RunInfo:
        """The stored run; one whose process is gone reads as interrupted even before an open
        records it (a read-only reader cannot)."""
        info = _run_info(row)
        why = self._gone(row)
        return replace(info, status=RunStatus.INTERRUPTED, note=why) if why else info

    def _interrupt_gone(self) -> None:
        """Record every running run whose process is gone as interrupted. Found without the
        write lock, so an open that finds none writes nothing; the update checks the status again
        under the lock, so a run finished meanwhile keeps its own."""
        rows = self._db.table("runs").rows_where("status = ?", [RunStatus.RUNNING.value])
        gone = [(RunStatus.INTERRUPTED.value, why, r["id"], RunStatus.RUNNING.value)
                for r in rows if (why := self._gone(r))]
        if gone:
            with self._write():
                self._db.conn.executemany("UPDATE runs SET status = ?, note = ? WHERE id = ? AND status = ?", gone)

    def _require_run(self, run_id: int) -> None:
        if self._db.table("runs").count_where("id = ?", [run_id]) == 0:
            raise UnknownRun(run_id)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


_CELL_FIELDS = tuple(f.name for f in fields(ResultCell))


def _cell_row(cell: ResultCell) -> dict[str, Any]:
    row = {name: getattr(cell, name) for name in _CELL_FIELDS}
    row["cache_on"] = int(cell.cache_on)
    row["extra"] = json.dumps(dict(cell.extra), sort_keys=True)
    return row


def _cell(row: Mapping[str, Any]) -> ResultCell:
    values = {name: row[name] for name in _CELL_FIELDS}
    values["cache_on"] = bool(values["cache_on"])
    values["extra"] = json.loads(values["extra"] or "{}")
    return ResultCell(**values)


def _run_info(row: Mapping[str, Any]) -> RunInfo:
    model = ModelFingerprint(name=row["model_name"], sha256=row["model_sha256"],
                             quant=row["model_quant"], size_bytes=row["model_size_bytes"])
    return RunInfo(id=row["id"], kind=row["kind"], note=row["note"], command=tuple(json.loads(row["command"])),
                   engine_settings=json.loads(row["engine_settings"]), model=model,
                   appliance_version=row["appliance_version"], started_at=row["started_at"],
                   finished_at=row["finished_at"], status=RunStatus(row["status"]))
