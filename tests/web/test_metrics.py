"""/metrics exposes what a soak needs to see a leak: the server's own process_* figures and each
engine process's RSS and open fds by model. A child process stands in for an engine, so the
figures are checked against /proc, not against a mock."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import Config, StoreConfig
from web import create_app
from web.metrics import Metrics

HOLD_FDS = "import sys, time; held = [open('/dev/null') for _ in range(7)]; print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def engine():
    """A process holding 7 more fds than a bare interpreter, as an engine's stand-in."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_FDS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait(10)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def test_process_and_engine_resources_are_exposed(engine):
    gone = dead_pid()
    metrics = Metrics(lambda: None, lambda: None, lambda: {"chat": engine.pid, "gone": gone})
    found = samples(metrics.render().decode())
    assert found[("process_resident_memory_bytes", ())] == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)
    assert found[("process_open_fds", ())] >= 3
    child = psutil.Process(engine.pid)
    rss = found[("appliance_engine_resident_memory_bytes", (("model", "chat"),))]
    assert rss == pytest.approx(child.memory_info().rss, rel=0.2)
    assert found[("appliance_engine_open_fds", (("model", "chat"),))] == child.num_fds() >= 3 + 7
    # a model whose engine has exited is left out, not reported as zero
    assert not any(labels == (("model", "gone"),) for _, labels in found)


class Pool:
    """No engine loaded for the other routes; one engine process for /metrics."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def client(self, name=None):
        return None

    def engine_pids(self):
        return {"SmolLM2": self.pid}


def test_the_app_scrapes_its_pools_engines(engine, tmp_path):
    app = create_app(Config(store=StoreConfig(db_path=str(tmp_path / "results.db"))), Pool(engine.pid))
    r = app.test_client().get("/metrics")
    assert r.status_code == 200
    found = samples(r.get_data(as_text=True))
    assert found[("appliance_engine_open_fds", (("model", "SmolLM2"),))] >= 10
    assert found[("appliance_engine_resident_memory_bytes", (("model", "SmolLM2"),))] > 0
    assert found[("process_resident_memory_bytes", ())] > 0 and found[("process_open_fds", ())] > 0


def test_the_disk_writers_queue_skips_and_errors_are_exposed():
    from prometheus_client import CollectorRegistry, generate_latest

    from appliance.engine.stats import CacheStats, EngineStats
    from web.metrics import EngineCollector

    registry = CollectorRegistry()
    stats = EngineStats(cache=CacheStats(disk_queued_bytes=4096, disk_skipped=2, disk_write_errors=1))
    registry.register(EngineCollector(lambda: stats, lambda: None))
    got = samples(generate_latest(registry).decode())
    assert got[("appliance_prompt_cache_disk_queued_bytes", ())] == 4096
    assert got[("appliance_prompt_cache_disk_skipped_total", ())] == 2
    assert got[("appliance_prompt_cache_disk_write_errors_total", ())] == 1
