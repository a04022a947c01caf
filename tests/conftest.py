"""Suite-wide set-up. On a machine without an NVIDIA GPU, Triton kernels run under its
interpreter: TRITON_INTERPRET must be set before Triton is first imported, by any module."""
import os
from pathlib import Path

if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
