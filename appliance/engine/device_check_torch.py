"""The device check's facts for the torch runner (device_check.py's `checked_torch` uses them).

The device side is the loaded torch runner on its CUDA or ROCm device; the CPU side is a second
torch runner on the same model (file or checkpoint directory) with `--torch-device cpu
--torch-kernels off --torch-graphs off` and one slot: the same code on its CPU path, loaded for
the check and closed right after, at the served context (the rotation can depend on it). The
key's build is torch's version and its CUDA or HIP version (`torch_build`); the model's digest
is device_reference.model_sha256 (for a checkpoint directory, of its files' listing). Torch is
imported only inside these functions: the llama.cpp path needs none of it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..config import EngineConfig
from .device_reference import device_logits
from .runners.base import ModelRunner

CPU_MARGIN = 64 * 2**20    # beyond the weights and the KV: the vocabulary, activations, the logits


def device_of(runner: ModelRunner) -> tuple[str, str] | None:
    """(torch's device name, its description) where the torch runner holds the model on a CUDA
    or ROCm device (torch names both "cuda"); None on the CPU."""
    name = str(runner.info.settings.get("device", "cpu"))
    if not name.startswith("cuda"):
        return None
    import torch

    return name, torch.cuda.get_device_name(torch.device(name))


def torch_build() -> str:
    """torch's build as the verdict's key holds it: its version and the CUDA or HIP it was built for."""
    import torch

    return f"torch {torch.__version__}" + (f", HIP {torch.version.hip}" if torch.version.hip
                                           else f", CUDA {torch.version.cuda}" if torch.version.cuda else "")


def cpu_config(cfg: EngineConfig) -> EngineConfig:
    """The CPU side's settings: the device's, on the CPU path, one slot, no tuned plan."""
    return dataclasses.replace(cfg, engine="torch", torch_device="cpu", torch_kernels="off", torch_graphs="off",
                               n_slots=1, plan="off")


def model_bytes(path: Path) -> int:
    """The model's bytes on disk: the file's, or the sum of a checkpoint directory's files'."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def cpu_side_bytes(runner: ModelRunner, cfg: EngineConfig) -> int:
    """What the CPU side holds, estimated: the model's weights at the CPU side's dtype (their
    element count, read from the loaded runner's tensors, times the dtype's size: the file's
    bytes re-expressed at that dtype), or the file's own bytes where its CPU path keeps the
    quantized blocks at their stored bits (int4, bfloat16) or the runner's tensors are not at
    hand; one slot's KV at the served context; CPU_MARGIN."""
    import torch

    from .runners.torch import qlinear
    from .runners.torch.runner import resolve_dtype

    c = cpu_config(cfg)
    dtype = resolve_dtype(c.torch_dtype, torch.device("cpu"))
    size = torch.finfo(dtype).bits // 8
    on_disk = model_bytes(Path(runner.info.model_path))
    weights = getattr(runner, "weights", None)
    if weights is None or c.torch_int4 and dtype == torch.bfloat16 and qlinear.available():
        held = on_disk
    else:
        held = sum(int(np.prod(t.shape)) for t in weights.tensors.values()) * size
    args = getattr(runner, "args", None)
    kv = args.n_layer * runner.info.n_ctx * 2 * args.n_head_kv * args.head_dim * size if args is not None else 0
    return held + kv + CPU_MARGIN


def cpu_reference(cfg: EngineConfig, path: Path, alias: str) -> Callable[[Sequence[int]], np.ndarray]:
    """The CPU side: the text's [T, V] logits from a torch runner on the CPU path, loaded for the
    call and closed after it."""
    from .runners import make_runner

    def logits(ids: Sequence[int]) -> np.ndarray:
        cpu = make_runner(cpu_config(cfg), path, alias)
        try:
            return device_logits(cpu, ids)
        finally:
            cpu.close()

    return logits
