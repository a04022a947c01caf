"""Model runners: the backends behind the `ModelRunner` protocol (base.py)."""
from __future__ import annotations

from pathlib import Path

from ...config import EngineConfig
from ...errors import ModelLoadError
from .base import ModelRunner


def make_runner(cfg: EngineConfig, model_path: Path, alias: str, defer_kernels: bool = False) -> ModelRunner:
    """The runner `--engine` names; each imports its backend only when chosen. defer_kernels:
    the torch runner may start on torch ops while its CPU kernels first build (TorchRunner.upgrade)."""
    if cfg.engine == "torch":
        if cfg.mmproj is not None:
            raise ModelLoadError("--mmproj: images are served by the llama.cpp runner only (--engine llamacpp)")
        if cfg.lora_files():
            raise ModelLoadError("--lora needs the llama.cpp engine (--engine llamacpp): the torch runner "
                                 "does not apply LoRA adapters")
        try:
            from .torch.runner import TorchRunner
        except ImportError as e:
            raise ModelLoadError(f"--engine torch needs PyTorch, which is not installed ({e}); "
                                 "install the torch extra: pip install 'appliance[torch]'") from None
        return TorchRunner(cfg, model_path, alias, defer_kernels)
    if Path(model_path).is_dir():
        raise ModelLoadError(f"{model_path}: a Hugging Face checkpoint directory is served by the torch runner "
                             "(--engine torch); llama.cpp reads GGUF files")
    from .llamacpp import LlamaCppRunner

    return LlamaCppRunner(cfg, model_path, alias)
