"""Suite-wide set-up. On a machine without an NVIDIA GPU, Triton kernels run under its
interpreter: TRITON_INTERPRET must be set before Triton is first imported, by any module.

Every server the suite starts remembers its start-up probes in one directory for the session
(--probe-cache, through APPLIANCE_PROBE_CACHE): each model, runner and setting is probed once per
run, not once per server. The probes themselves are tested on engines built in-process, which
do not read the environment; the speculation identity modules pass the directory to theirs
(the same runners in two modules: the first measures, the second remembers)."""
import os
import shutil
import tempfile
from pathlib import Path

if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    if "APPLIANCE_PROBE_CACHE" not in os.environ:
        session.config.probe_cache = tempfile.mkdtemp(prefix="appliance-probes-")
        os.environ["APPLIANCE_PROBE_CACHE"] = session.config.probe_cache
    _build_cpu_kernels()


def pytest_sessionfinish(session):
    made = getattr(session.config, "probe_cache", None)
    if made:
        os.environ.pop("APPLIANCE_PROBE_CACHE", None)
        shutil.rmtree(made, ignore_errors=True)


def _build_cpu_kernels() -> None:
    """The torch runner's CPU kernels are built before any test runs: an engine started before
    their first build serves on torch ops and moves to them when idle, which would change a
    server's arithmetic in the middle of a module (that first start is tested on its own, in
    tests/engine/test_deferred_kernels.py, with the build held)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        from appliance.engine.runners.torch import cpu_kernels

        cpu_kernels.load()
