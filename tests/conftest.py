"""Suite-wide set-up. On a machine without an NVIDIA GPU, Triton kernels run under its
interpreter: TRITON_INTERPRET must be set before Triton is first imported, by any module."""
import os
from pathlib import Path

if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """The torch runner's CPU kernels are built before any test runs: an engine started before
    their first build serves on torch ops and moves to them when idle, which would change a
    server's arithmetic in the middle of a module (that first start is tested on its own, in
    tests/engine/test_deferred_kernels.py, with the build held)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        from appliance.engine.runners.torch import cpu_kernels

        cpu_kernels.load()
