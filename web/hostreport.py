"""/api/host: appliance hostcheck's report as JSON, for the host page.

The body is `appliance hostcheck --json` (`hostcheck.as_json`: "snapshot", "advice",
"unavailable", "llama_cpp" when known) plus "collected_at" (UTC, ISO 8601), "source" ("this
host", or the saved report's file name), "cached" (the snapshot is one taken earlier),
"model" (the loaded model the advice was checked against, or null) and "sources" (where each
CPU, memory, kernel, IOMMU and GTT-limit fact is read; the GPU and power records carry their
own). With `--host-report PATH` the saved report is served instead of checking this host.

A snapshot of this host is kept for CACHE_S seconds (collecting samples RAPL power over a
quarter second and runs nvidia-smi / rocminfo, which can take a second or more); `?refresh=1`
takes a new one. Advice is worked out again on every request (pure, and the loaded model may
have changed).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flask import Blueprint, current_app, jsonify, request

from appliance.errors import ApplianceError
from hostcheck import HostSnapshot, as_json, check, collect
from hostcheck.advice import LlamaBuild, LlamaDevice, model_bytes_of
from hostcheck.cpu import CPU
from hostcheck.iommu import GROUPS, UNITS
from hostcheck.memory import THP

bp = Blueprint("hostreport", __name__)
log = logging.getLogger("appliance.web.host")

CACHE_S = 30.0
GPU_KINDS = ("gpu", "igpu")   # ggml device kinds that llama_supports_gpu_offload counts

# Where the probes read each fact (hostcheck/cpu.py, memory.py, kernel.py, iommu.py, gpu_amd.py);
# tests/web/test_host_api.py checks that every field of those records has an entry.
SOURCES: dict[str, dict[str, str]] = {
    "cpu": {
        "model": "/proc/cpuinfo (else lscpu)", "vendor": "/proc/cpuinfo vendor_id",
        "logical_cpus": "/proc/cpuinfo",
        "physical_cores": f"/proc/cpuinfo core ids (else {CPU}/cpu*/topology)",
        "smt_active": f"{CPU}/smt/active", "smt_control": f"{CPU}/smt/control",
        "virtual_machine": "/proc/cpuinfo hypervisor flag",
        "scaling_driver": f"{CPU}/cpu0/cpufreq/scaling_driver",
        "governor": f"{CPU}/cpu*/cpufreq/scaling_governor",
        "energy_perf_preference": f"{CPU}/cpu0/cpufreq/energy_performance_preference",
        "boost": f"{CPU}/cpufreq/boost (else intel_pstate/no_turbo)",
        "cur_mhz": f"median of {CPU}/cpu*/cpufreq/scaling_cur_freq (else /proc/cpuinfo)",
        "max_mhz": f"highest {CPU}/cpu*/cpufreq/cpuinfo_max_freq",
    },
    "memory": {"total_bytes": "/proc/meminfo MemTotal", "available_bytes": "/proc/meminfo MemAvailable",
               "thp_enabled": f"{THP}/enabled", "thp_defrag": f"{THP}/defrag"},
    "kernel": {"release": "/proc/sys/kernel/osrelease", "cmdline": "/proc/cmdline",
               "distribution": "/etc/os-release PRETTY_NAME"},
    "iommu": {"units": UNITS, "group_types": f"{GROUPS}/*/type",
              "gpu_group_type": f"{GROUPS}/*/type of the group holding the display controller",
              "cmdline": "/proc/cmdline"},
    "gtt_limits": {"ttm_pages_limit": "/sys/module/ttm/parameters/pages_limit",
                   "amdgpu_gttsize_mib": "/sys/module/amdgpu/parameters/gttsize", "cmdline": "/proc/cmdline"},
}


class HostReportUnavailable(ApplianceError):
    """The saved host report cannot be read or is not hostcheck's JSON."""

    status, type, code = 500, "server_error", "host_report_unavailable"


class HostCheckFailed(ApplianceError):
    """Checking this host raised (the probes should not; this is a bug in one)."""

    status, type, code = 500, "server_error", "host_check_failed"


@dataclass
class _Cache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    snap: HostSnapshot | None = None
    at: float = 0.0


@bp.get("/api/host")
def host_report():
    path = current_app.extensions["appliance"].config.server.host_report
    body = _saved(Path(path).expanduser()) if path else _live(_truthy(request.args.get("refresh")))
    return jsonify(body)


def _truthy(arg: str | None) -> bool:
    return (arg or "").lower() in ("1", "true", "yes")


def _saved(path: Path) -> dict[str, Any]:
    """The saved `appliance hostcheck --json` output, read again on every request."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise HostReportUnavailable(f"cannot read the host report {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise HostReportUnavailable(f"the host report {path} is not valid JSON: {e}") from None
    if not (isinstance(data, dict) and isinstance(data.get("snapshot"), dict)
            and isinstance(data.get("advice"), list) and all(isinstance(a, dict) for a in data["advice"])):
        raise HostReportUnavailable(f"the host report {path} is not 'appliance hostcheck --json' output: "
                                    "it needs a JSON object with \"snapshot\" (an object) and \"advice\" "
                                    "(a list of objects)")
    taken = data["snapshot"].get("taken_at")
    if not isinstance(taken, str):
        mtime = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
        taken = mtime.isoformat(timespec="seconds")
    return {**data, "collected_at": taken, "source": path.name, "cached": False, "model": None,
            "sources": SOURCES}


def _live(refresh: bool) -> dict[str, Any]:
    snap, cached = _snapshot(refresh)
    llama, model = _engine_facts()
    advice = check(snap, model_bytes=model["bytes"] if model else None, llama=llama)
    return {**as_json(snap, advice, llama), "collected_at": snap.taken_at, "source": "this host",
            "cached": cached, "model": model, "sources": SOURCES}


def _snapshot(refresh: bool) -> tuple[HostSnapshot, bool]:
    """This host's snapshot, from the cache unless it is older than CACHE_S or refresh is asked.
    One collection at a time: a request arriving meanwhile waits for it and gets its result."""
    cache = current_app.extensions.setdefault("hostreport", _Cache())
    with cache.lock:
        if not refresh and cache.snap is not None and time.monotonic() - cache.at < CACHE_S:
            return cache.snap, True
        try:
            snap = collect()
        except Exception as e:
            log.exception("hostcheck failed")
            raise HostCheckFailed(f"checking this host failed: {type(e).__name__}: {e}") from None
        cache.snap, cache.at = snap, time.monotonic()
        return snap, False


def _engine_facts() -> tuple[LlamaBuild | None, dict[str, Any] | None]:
    """What the loaded default model's engine reported at load: the llama.cpp build it runs (its
    version and ggml devices, so hostcheck can say when a GPU goes unused) and the model file.

    `appliance hostcheck` asks llama.cpp itself (cli._llama_build), but only the engine process
    may import llama.cpp, so the server uses the engine's report (/health's settings and
    placement) instead; with no model loaded, or another backend, there is none (llama=None)."""
    engine = current_app.extensions["appliance"].engine
    info = engine.info if engine is not None else None
    if info is None:
        return None, None
    llama = None
    devices = info.placement.get("llama_devices") if info.backend == "llama.cpp" else None
    if isinstance(devices, list):
        llama = LlamaBuild(str(info.settings.get("llama_cpp_python", "unknown")),
                           any(d.get("kind") in GPU_KINDS for d in devices),
                           tuple(LlamaDevice(d["name"], d["description"], d["free"], d["total"], d.get("kind", ""),
                                             bool(d.get("host_memory")))
                                 for d in devices))
    try:
        size = model_bytes_of(info.model_path)
    except OSError:
        return llama, None
    return llama, {"name": info.model_name, "bytes": size}
