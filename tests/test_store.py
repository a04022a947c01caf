"""The result store: migrations, the typed API, durability under kill -9, runs whose process is
gone, readers beside a writer, the model fingerprint, and where the database file lives. Each
test has its own database under tmp_path; writers and readers that must be separate processes
are real ones."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
import sqlite_utils

import appliance
from appliance import config, store as store_mod
from appliance.models import embedded_model_path, gguf_quant_name, model_fingerprint
from appliance.run_owner import Owner
from appliance.store import HostRecord, ModelFingerprint, ResultCell, RunStatus, Store, UnknownRun

ROOT = Path(appliance.__file__).resolve().parent.parent
FP = ModelFingerprint(name="m.gguf", sha256="ab" * 32, quant="Q4_1", size_bytes=1234)
MIGRATION_NAMES = ["0001_runs_host_snapshots_results", "0002_cell_kind_target_variant_extra", "0003_run_owner",
                   "0004_cell_energy_power_cap"]


def cell(prompt_set: str = "prose", repeat_index: int = 0, **kw) -> ResultCell:
    values = dict(mode="serial", prompt_set=prompt_set, depth=512, prompt_tokens=512,
                  generated_tokens=128, ttft_ms=101.5, prefill_tps=5044.3, client_decode_tps=92.25,
                  engine_decode_tps=96.5, tokens_per_step=1.0, concurrency=1,
                  repeat_index=repeat_index, cache_on=False, cached_tokens=0)
    return ResultCell(**{**values, **kw})


# A writer process: one run, then batches of N cells that share a marker (prompt_set "b<i>"),
# printing "batch i" after each commit. BATCHES = 0 writes until it is killed.
WRITER = """
import sys
from appliance.store import ModelFingerprint, ResultCell, Store
path, n, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = Store.open(path)
run_id = store.start_run(["writer"], {"n": n}, ModelFingerprint("m.gguf", "0" * 64, "F32", 1))
print("run", run_id, flush=True)
i = 0
while batches == 0 or i < batches:
    store.add_cells(run_id, [ResultCell("serial", f"r{run_id}-b{i}", j, 10, 10, 1.0, None, None,
                                        None, None, repeat_index=j) for j in range(n)])
    print("batch", i, flush=True)
    i += 1
store.finish_run(run_id, "complete")
"""


# A run whose process does nothing more until it is killed.
SLEEPER = """
import sys, time
from appliance.store import ModelFingerprint, Store
store = Store.open(sys.argv[1])
print(store.start_run(["sleeper"], {}, ModelFingerprint("m.gguf", "0" * 64, "F32", 1)), flush=True)
time.sleep(120)
"""


def start_python(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def start_writer(db: Path, n: int, batches: int = 0) -> subprocess.Popen:
    return start_python(WRITER, str(db), str(n), str(batches))


def read_until_batch(proc: subprocess.Popen, k: int) -> int:
    """Read the writer's output until batch k is committed; returns the last batch seen."""
    last = -1
    while last < k:
        line = proc.stdout.readline()
        assert line, f"writer exited early: {proc.stderr.read()}"
        if line.startswith("batch"):
            last = int(line.split()[1])
    return last


def batch_counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT prompt_set, count(*) FROM results GROUP BY prompt_set"))


# -- migrations ----------------------------------------------------------------------------

def test_migrations_from_empty(tmp_path):
    with Store.open(tmp_path / "sub" / "r.db") as s:
        assert set(s.db.table_names()) == {"_migrations", "runs", "host_snapshots", "results"}
        rows = list(s.db.query("SELECT name, applied_at FROM _migrations ORDER BY id"))
        assert [r["name"] for r in rows] == MIGRATION_NAMES
        assert all(r["applied_at"] for r in rows)
        assert s.db.journal_mode == "wal"
        assert s.db.execute("PRAGMA busy_timeout").fetchone()[0] == store_mod.BUSY_TIMEOUT_MS
        assert s.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_reopen_applies_nothing_twice(tmp_path):
    db = tmp_path / "r.db"
    with Store.open(db) as s:
        first = list(s.db.query("SELECT * FROM _migrations"))
        run_id = s.start_run(["x"], {}, FP)
    for _ in range(2):
        with Store.open(db) as s:
            assert list(s.db.query("SELECT * FROM _migrations")) == first
            assert s.run(run_id).command == ("x",)


def test_new_migration_is_applied_once_alone(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    Store.open(db).close()
    extended = store_mod._Migrations("appliance")
    extended(name=MIGRATION_NAMES[0])(store_mod._create_tables)
    extended(name="0002_extra")(lambda d: d.table("extra").create({"id": int}, pk="id"))
    monkeypatch.setattr(store_mod, "MIGRATIONS", extended)
    with Store.open(db) as s:
        names = [r["name"] for r in s.db.query("SELECT name FROM _migrations ORDER BY id")]
        assert names == [*MIGRATION_NAMES, "0002_extra"]
        assert "extra" in s.db.table_names()
    Store.open(db).close()  # a third open finds nothing pending


def test_failed_migration_rolls_back_and_stays_pending(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    Store.open(db).close()
    broken = store_mod._Migrations("appliance")
    broken(name=MIGRATION_NAMES[0])(store_mod._create_tables)

    @broken(name="0002_broken")
    def _half(d):
        d.table("half").create({"id": int}, pk="id")
        raise RuntimeError("migration failed")

    monkeypatch.setattr(store_mod, "MIGRATIONS", broken)
    with pytest.raises(RuntimeError):
        Store.open(db)
    with sqlite3.connect(db) as conn:
        assert [n for (n,) in conn.execute("SELECT name FROM _migrations")] == MIGRATION_NAMES
        assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'half'").fetchall()


# -- the typed API -------------------------------------------------------------------------

def test_run_round_trip(tmp_path):
    with Store.open(tmp_path / "r.db") as s:
        assert s.runs() == [] and s.last_run() is None
        run_id = s.start_run(["appliance", "bench", "--runs", "3"], {"n_ctx": 8192, "flash_attn": False},
                             FP, appliance_version="9.9")
        info = s.run(run_id)
        assert info.id == run_id and info.status is RunStatus.RUNNING and info.finished_at is None
        assert info.command == ("appliance", "bench", "--runs", "3")
        assert info.engine_settings == {"n_ctx": 8192, "flash_attn": False}
        assert info.model == FP and info.appliance_version == "9.9"
        cells = [cell(repeat_index=i) for i in range(3)]
        cells.append(cell("code", mode="lookup", prefill_tps=None, engine_decode_tps=None,
                          tokens_per_step=2.5, concurrency=4, cache_on=True, cached_tokens=500))
        assert s.add_cells(run_id, cells[:2]) == 2
        assert s.add_cells(run_id, cells[2:]) == 2
        assert s.add_cells(run_id, []) == 0
        assert s.results(run_id) == cells
        s.finish_run(run_id, "complete")
        done = s.run(run_id)
        assert done.status is RunStatus.COMPLETE and done.finished_at >= done.started_at
        second = s.start_run(["appliance", "sweep"], {}, FP)
        assert [r.id for r in s.runs()] == [run_id, second]
        assert s.last_run().id == second and s.results(second) == []


def test_cells_of_every_kind_round_trip_with_their_extras(tmp_path):
    with Store.open(tmp_path / "r.db") as s:
        run_id = s.start_run(["appliance", "sweep"], {}, FP, kind="sweep")
        cells = [cell(kind="concurrency", target="raw", variant="B", engine_prefill_tps=812.5,
                      extra={"aggregate_tps": 121.3, "group": 2}),
                 cell(kind="needle", extra={"found": True, "status": 200})]
        s.add_cells(run_id, cells)
        assert s.results(run_id) == cells
        s.finish_run(run_id, RunStatus.INTERRUPTED, note="missing: sweep p=8192 runs 2-3")
        info = s.run(run_id)
        assert info.kind == "sweep" and info.note == "missing: sweep p=8192 runs 2-3"


def test_a_database_of_the_first_schema_upgrades_with_defaults(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    first = store_mod._Migrations("appliance")
    first(name=MIGRATION_NAMES[0])(store_mod._create_tables)
    monkeypatch.setattr(store_mod, "MIGRATIONS", first)
    with Store.open(db) as s:
        s.db.table("runs").insert({"started_at": "2026-01-01T00:00:00", "status": "complete",
                                   "command": "[]", "engine_settings": "{}", "model_name": "m",
                                   "model_sha256": "0", "model_quant": "F32", "model_size_bytes": 1,
                                   "appliance_version": "0.1"})
        s.db.table("results").insert({"run_id": 1, "mode": "serial", "prompt_set": "sweep",
                                      "depth": 512, "prompt_tokens": 512, "generated_tokens": 8,
                                      "ttft_ms": 100.0, "concurrency": 1, "repeat_index": 0,
                                      "cache_on": 0, "cached_tokens": 0})
    monkeypatch.undo()
    with Store.open(db) as s:
        (old,) = s.results(1)
        assert (old.kind, old.target, old.variant, old.extra) == ("sweep", "served", "", {})
        assert s.run(1).kind == "bench" and s.run(1).note == ""


def test_host_snapshot_one_per_run(tmp_path):
    with Store.open(tmp_path / "r.db") as s:
        run_id = s.start_run(["bench"], {}, FP)
        assert s.host(run_id) is None
        snapshot = {"kernel": "6.8.0", "cmdline": "iommu=pt", "memory": {"gtt_bytes": 1 << 30}}
        phases = {"prefill": {"power_w": 84.5, "gpu_mhz": 2900}, "decode": {"power_w": 61.0}}
        s.record_host(run_id, snapshot, phases)
        host = s.host(run_id)
        assert isinstance(host, HostRecord) and host.snapshot == snapshot and host.phases == phases
        s.record_host(run_id, snapshot, {"decode": {"power_w": 70.0}})
        assert s.host(run_id).phases == {"decode": {"power_w": 70.0}}
        assert s.db.table("host_snapshots").count == 1


def test_unknown_run_and_bad_values_are_refused(tmp_path):
    with Store.open(tmp_path / "r.db") as s:
        with pytest.raises(UnknownRun):
            s.run(7)
        with pytest.raises(UnknownRun):
            s.add_cells(7, [cell()])
        with pytest.raises(UnknownRun):
            s.finish_run(7, RunStatus.FAILED)
        with pytest.raises(UnknownRun):
            s.record_host(7, {}, {})
        run_id = s.start_run(["bench"], {}, FP)
        with pytest.raises(ValueError):
            s.finish_run(run_id, "running")
        with pytest.raises(ValueError):
            s.finish_run(run_id, "done")
        assert s.db.table("results").count == 0 and s.db.table("host_snapshots").count == 0
    for bad in ({"depth": -1}, {"concurrency": 0}, {"mode": ""}, {"ttft_ms": -1.0}):
        with pytest.raises(ValueError):
            cell(**bad)


# -- durability and concurrency ------------------------------------------------------------

def test_kill_9_leaves_only_complete_batches(tmp_path):
    db, n = tmp_path / "r.db", 200
    rng = random.Random(4)
    committed = 0
    for _ in range(3):  # three kills, each at a random moment in the middle of the writes
        proc = start_writer(db, n)
        try:
            seen = read_until_batch(proc, rng.randrange(3, 10))
            time.sleep(rng.uniform(0, 0.02))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        counts = batch_counts(db)
        assert set(counts.values()) == {n}, "a batch was stored in part"
        assert len(counts) >= committed + seen + 1  # every batch it reported is there
        committed = len(counts)
    with Store.open(db) as s:
        assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert s.db.execute("PRAGMA foreign_key_check").fetchall() == []
        assert [r.status for r in s.runs()] == [RunStatus.INTERRUPTED] * 3   # their processes are gone


# -- runs whose process is gone ----------------------------------------------------------------

def read_only(db: Path) -> Store:
    """A Store over a read-only connection, as the web page opens the file."""
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    return Store(sqlite_utils.Database(conn, execute_plugins=False), db)


def stored_status(db: Path, run_id: int) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT status FROM runs WHERE id = ?", [run_id]).fetchone()[0]


def test_a_run_killed_with_kill_9_is_interrupted_at_the_next_open(tmp_path):
    db = tmp_path / "r.db"
    proc = start_python(SLEEPER, str(db))
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        run_id = int(line)
        with Store.open(db) as s:      # its process lives: another opener leaves it alone
            assert s.run(run_id).status is RunStatus.RUNNING
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with read_only(db) as s:           # a read-only reader tells it, and cannot record it
        assert s.run(run_id).status is RunStatus.INTERRUPTED
    assert stored_status(db, run_id) == "running"
    with Store.open(db) as s:
        info = s.run(run_id)
    assert stored_status(db, run_id) == "interrupted" and info.finished_at is None
    assert info.note == (f"process {proc.pid} on {socket.gethostname()}, which wrote this run, is gone: "
                         "it ended without finishing the run")


def test_which_runs_are_judged_gone(tmp_path):
    db, me = tmp_path / "r.db", Owner.current()
    no_such_pid = int(Path("/proc/sys/kernel/pid_max").read_text())    # pids stay below it
    owners = {  # run -> what its owner columns are changed to, and whether it is then gone
        "mine": ({}, False),
        "dead pid": ({"pid": no_such_pid}, True),
        "reused pid": ({"start": me.start - 1}, True),
        "host restarted": ({"boot": "another boot", "pid": no_such_pid}, True),
        "another host": ({"host": "elsewhere", "pid": no_such_pid}, False),
        "another container": ({"pidns": "pid:[1]", "pid": no_such_pid}, False),
        "written before owners": ({"host": None, "boot": None, "pidns": None, "pid": None, "start": None}, False),
    }
    with Store.open(db) as s:
        ids = {name: s.start_run([name], {}, FP) for name in owners}
        finished = s.start_run(["finished"], {}, FP)
        s.finish_run(finished, "complete")
        for name, (changes, _) in [*owners.items(), ("finished", ({"pid": no_such_pid}, False))]:
            if changes:
                s.db.table("runs").update(ids.get(name, finished), {f"owner_{k}": v for k, v in changes.items()})
    with Store.open(db) as s:
        got = {name: s.run(run_id) for name, run_id in ids.items()}
        assert s.run(finished).status is RunStatus.COMPLETE
    for name, (_, gone) in owners.items():
        assert stored_status(db, ids[name]) == ("interrupted" if gone else "running"), name
        assert got[name].status is (RunStatus.INTERRUPTED if gone else RunStatus.RUNNING), name
    assert got["reused pid"].note.startswith(f"process {me.pid} on {me.host}, which wrote this run, is gone")
    assert got["host restarted"].note.endswith("is gone: the host restarted since")


def test_reader_beside_a_writer_never_sees_locked_or_partial(tmp_path):
    db, n = tmp_path / "r.db", 25
    proc = start_writer(db, n)
    try:
        read_until_batch(proc, 0)
        reader = Store.open(db)
        totals, opens = [], 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            run = reader.last_run()
            cells = reader.results(run.id)
            assert len(cells) % n == 0, "a reader saw a batch in part"
            totals.append(len(cells))
            with Store.open(db) as fresh:  # opening while the writer writes never fails either
                assert fresh.runs()[-1].id == run.id
                opens += 1
        reader.close()
        assert proc.poll() is None, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(10)
    assert totals == sorted(totals) and totals[-1] > totals[0], "the writer made no progress"
    assert opens > 5


def test_concurrent_writers_on_a_new_file(tmp_path):
    db, n, batches = tmp_path / "r.db", 20, 30
    procs = [start_writer(db, n, batches) for _ in range(3)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    with Store.open(db) as s:
        assert [r["name"] for r in s.db.query("SELECT name FROM _migrations")] == MIGRATION_NAMES
        runs = s.runs()
        assert len(runs) == 3 and {r.status for r in runs} == {RunStatus.COMPLETE}
        assert all(len(s.results(r.id)) == n * batches for r in runs)


# -- model fingerprint ---------------------------------------------------------------------

def test_fingerprint_of_a_plain_file(tmp_path):
    data = random.Random(1).randbytes(3 * 1024 * 1024 + 123)  # crosses chunk boundaries
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    fp = model_fingerprint(path)
    assert fp == ModelFingerprint("blob.bin", hashlib.sha256(data).hexdigest(), "unknown", len(data))


def write_gguf(path: Path, file_type: int | None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    if file_type is not None:
        w.add_uint32("general.file_type", file_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("file_type,name", [
    (gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"), (gguf.LlamaFileType.MOSTLY_Q8_0, "Q8_0"),
    (gguf.LlamaFileType.ALL_F32, "F32"), (gguf.LlamaFileType.MOSTLY_BF16, "BF16"),
    (999, "unknown"), (None, "unknown"),
])
def test_quant_name_from_a_tiny_gguf(tmp_path, file_type, name):
    assert gguf_quant_name(write_gguf(tmp_path / "t.gguf", file_type)) == name


def test_quant_name_of_a_truncated_gguf_is_unknown(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    assert gguf_quant_name(path) == "unknown"


def test_fingerprint_of_the_embedded_model():
    path = embedded_model_path()
    fp = model_fingerprint(path)
    assert fp.quant == "Q4_1" and fp.name == path.name and fp.size_bytes == path.stat().st_size
    with path.open("rb") as f:
        assert fp.sha256 == hashlib.file_digest(f, "sha256").hexdigest()


# -- where the file lives ------------------------------------------------------------------

def test_db_path_setting_overrides_the_default(tmp_path):
    env = {"APPLIANCE_DB_PATH": str(tmp_path / "mine.db"), "XDG_DATA_HOME": str(tmp_path / "xdg")}
    assert config.load({}, env=env).store.resolved_db_path(env) == tmp_path / "mine.db"
    flags = {"db_path": str(tmp_path / "flag.db")}
    assert config.load(flags, env=env).store.resolved_db_path(env) == tmp_path / "flag.db"


def test_default_db_path_is_under_xdg_data_home(tmp_path):
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    cfg = config.load({}, env=env)
    assert cfg.store.db_path is None
    path = cfg.store.resolved_db_path(env)
    assert path == tmp_path / "xdg" / "appliance" / "results.db"
    Store.open(path).close()  # creates the directory
    assert path.is_file()


@pytest.mark.parametrize("xdg", [None, "", "relative/dir"])
def test_default_db_path_falls_back_to_local_share(tmp_path, xdg):
    env = {"HOME": str(tmp_path)} | ({} if xdg is None else {"XDG_DATA_HOME": xdg})
    path = config.load({}, env=env).store.resolved_db_path(env)
    assert path == tmp_path / ".local" / "share" / "appliance" / "results.db"
