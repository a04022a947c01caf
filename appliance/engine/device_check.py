"""The device check: does the GPU compute what the CPU computes? (issue 72)

A GPU can compute garbage and nothing else notices: with ROCm on gfx1151 llama.cpp gave
perplexity 1,334 where the CPU and Vulkan gave 6.81 (llama.cpp issue #28211). So when a model
starts with layers on a GPU, the engine runs a fixed text (CHECK_TEXT, 64 to 128 tokens) through
the device and through llama.cpp's CPU backend on the same file (device_reference.py) and
compares the logits position by position (logit_compare.py):

    verdict  agrees (within TOLERANCE): serve
             differs: refuse the start (--device-check on) naming the device, the build and
                      what differed; or serve and warn (--device-check warn)
             skipped: no layer on a GPU, or the CPU side does not fit in the free memory

The verdict is remembered (VerdictCache) in the data directory by the model's sha256,
llama.cpp's build, the device and its driver: a restart costs nothing, a rebuild or a new
driver checks again. It is /health's settings.device_check, logged at start, listed by
hostcheck, and stored with every bench result (the engine's settings are).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..config import default_data_dir
from ..errors import ModelLoadError
from . import device_reference as ref
from .device_partial import partial
from .device_verdict import CHECK_TEXT, NO_GPU, TOLERANCE, DeviceVerdict, Target, check_ids
from .logit_compare import LogitComparison, Tolerance, compare, departures
from .runners.base import ModelRunner

log = logging.getLogger("appliance.engine")

def llamacpp_target(runner: ModelRunner) -> Target | None:
    """The GPU holding the llama.cpp runner's layers (None: no layer on a GPU)."""
    placed = getattr(runner, "placed", None)
    if placed is None or placed.gpu is None or placed.placement.n_gpu_layers <= 0:
        return None
    dev = next(d for d in placed.devices if d.name == placed.gpu)
    n_layer = placed.facts.n_layer
    on_gpu = sum(1 for where in placed.placement.layers.values() if where != "CPU")
    output = any(placed.placement.where.get(t.name, "CPU") != "CPU" for t in placed.facts.tensors if t.role == "output")
    weights = sum(sum(u.weights.values()) for name, u in placed.placement.use.items() if name != "CPU")
    return Target(dev.name, dev.description, f"{on_gpu} of {n_layer} layers{' and the output' if output else ''}",
                  weights + 64 * 2**20, dev.handle, dev.host_memory or dev.kind == "igpu")


def run(runner: ModelRunner, target: Target, reference: Callable[[Sequence[int]], np.ndarray],
        build: str, driver: str, sha256: str, tolerance: Tolerance = TOLERANCE) -> DeviceVerdict:
    """Measure: the text on the device, then on the CPU, compared."""
    ids = check_ids(runner)
    t0 = time.perf_counter()
    dev = ref.device_logits(runner, ids)
    t1 = time.perf_counter()
    cpu = reference(ids)
    t2 = time.perf_counter()
    c: LogitComparison = compare(dev, cpu, ids)
    gone = departures(c, tolerance)
    return DeviceVerdict("differs" if gone else "agrees", f"{target.name} ({target.description})", driver, build,
                         sha256, f"the whole model, {target.holds} on {target.name}, {len(ids)} tokens",
                         c.as_dict(), tuple(gone), tolerance.as_dict(), round(t1 - t0, 3), round(t2 - t1, 3))


class VerdictCache:
    """Verdicts on disk, one JSON file per key (model sha256, llama.cpp build, device, driver), in
    device-check/ of the data directory unless told."""

    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory if directory is not None else default_data_dir() / "device-check"

    @staticmethod
    def key(sha256: str, build: str, device: str, driver: str) -> dict:
        return {"model_sha256": sha256, "build": build, "device": device, "driver": driver}

    def _path(self, key: dict) -> Path:
        return self.dir / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"

    def get(self, key: dict) -> DeviceVerdict | None:
        try:
            stored = json.loads(self._path(key).read_text())
            return self._verdict(stored) if stored["key"] == key else None
        except (OSError, ValueError, TypeError, KeyError):
            return None

    @staticmethod
    def _verdict(stored: dict) -> DeviceVerdict:
        v = stored["verdict"]
        return DeviceVerdict(**{**v, "differed": tuple(v["differed"]), "cached": True})

    def put(self, key: dict, verdict: DeviceVerdict) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self._path(key)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "verdict": asdict(verdict)}, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("device check: verdict not remembered in %s: %s", self.dir, e)

    def all(self) -> list[DeviceVerdict]:
        """Every remembered verdict (hostcheck lists them), newest first."""
        out = []
        for f in sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) \
                if self.dir.is_dir() else []:
            try:
                out.append(self._verdict(json.loads(f.read_text())))
            except (OSError, ValueError, TypeError, KeyError):
                continue
        return out


def checked(runner: ModelRunner, cache: VerdictCache | None, fresh: bool = False,
            reference_path: Path | None = None) -> DeviceVerdict:
    """The llama.cpp runner's verdict: remembered, else measured and remembered (`fresh`: measured
    whatever is remembered). `reference_path` is the file the CPU side reads (default: the one the
    runner loaded; `appliance check --reference`: a known-good copy): a verdict on two files is
    neither read from nor written to the cache, which holds each file's against itself."""
    import psutil

    if reference_path is not None:
        cache = None
    target = llamacpp_target(runner)
    if target is None:
        return DeviceVerdict("skipped", why=NO_GPU)
    path = Path(runner.info.model_path)
    build, driver = ref.llama_build(), ref.driver_version(target.name, target.description)
    sha = ref.model_sha256(path, cache.dir if cache is not None else None)
    key = VerdictCache.key(sha, build, f"{target.name} ({target.description})", driver)
    found = None if fresh or cache is None else cache.get(key)
    if found is not None:
        return found
    available = psutil.virtual_memory().available
    s = getattr(runner, "llamacpp")
    kw = {"n_threads": s.n_threads_batch, "flash_attn": s.flash_attn, "kv_type": runner.kv_type}
    if target.cpu_side_bytes > available:       # the first and last layers, as a model of their own
        whole = (f"the whole model's CPU side needs about {target.cpu_side_bytes / 2**30:.1f} GiB, "
                 f"{available / 2**30:.1f} GiB are available")
        verdict = partial(runner, target, (path, reference_path or path), (build, driver, sha), whole, available,
                          cache.dir if cache is not None else Path(tempfile.gettempdir()), kw)
    else:
        verdict = run(runner, target, lambda ids: ref.cpu_logits(reference_path or path, ids, **kw), build, driver, sha)
    if cache is not None and verdict.verdict != "skipped":     # skipped: tried again at the next start
        cache.put(key, verdict)
    return verdict


def at_start(mode: str, runner: ModelRunner, cache_dir: Path | None = None) -> dict:
    """The engine's start: the check as --device-check says (off | warn | on), logged; raises
    ModelLoadError with the refusal where it differs and the mode is on. /health's report."""
    if mode == "off":
        return {"mode": "off"}
    if runner.info.backend != "llama.cpp":
        return DeviceVerdict("skipped", why=f"the {runner.info.backend} runner: `appliance check` compares it "
                                            "with its CPU path on demand").report(mode)
    try:
        verdict = checked(runner, VerdictCache(cache_dir))
    except ModelLoadError as e:          # the CPU side could not run: nothing compared, nothing refused
        verdict = DeviceVerdict("skipped", why=e.message)
    if verdict.verdict == "differs":
        if mode == "on":
            raise ModelLoadError(verdict.refusal())
        log.warning("device check: %s (--device-check warn: serving anyway)", verdict.refusal())
    else:
        quiet = verdict.verdict == "agrees" or verdict.why == NO_GPU
        (log.info if quiet else log.warning)("device check: %s", verdict.describe())
    return verdict.report(mode)

