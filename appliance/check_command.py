"""`appliance check MODEL`: the device check (engine/device_check.py) on demand, measured afresh
and remembered for the next start.

With the llama.cpp runner (the default) the model is loaded as `serve` would place it (every
layer that fits on the GPU, or as --n-gpu-layers and the other placement flags say) and compared
with llama.cpp's CPU backend on the same file. With `--engine torch` on a CUDA or ROCm device the
torch runner there is compared with the torch runner on the CPU (its CPU path), as at every such
start (device_check.checked_torch); without such a device it refuses, saying so. Exit status: 0
agrees, 1 differs, 2 bad input or nothing to check.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from . import config, flags

# serve's flags that change what the check runs on
ENGINE_FLAGS = frozenset({"engine", "n_gpu_layers", "main_gpu", "override_tensor", "cpu_moe", "n_cpu_moe",
                          "tensor_split", "kv_type", "flash_attn", "n_threads", "n_threads_batch",
                          "torch_device", "torch_dtype", "torch_kernels"})


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check that the GPU computes what the CPU computes, for a model",
                       description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1])
    p.add_argument("model", metavar="MODEL", help="the GGUF (or, with --engine torch, a checkpoint directory)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--reference", metavar="GGUF", type=Path,
                   help="the file llama.cpp's CPU backend reads (default: MODEL): a known-good copy to compare "
                        "a suspect file on the device with; such a verdict is not remembered")
    flags.add_arguments(p, config.EngineConfig, only=ENGINE_FLAGS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .errors import ApplianceError

    given = {k: v for k, v in vars(args).items() if k in ENGINE_FLAGS}
    try:
        cfg = dataclasses.replace(config.load(given).engine, model=args.model, n_ctx=512, n_slots=1, plan="off",
                                  speculate="off", prompt_cache="off", device_check="off")
        verdict = torch_verdict(cfg) if cfg.engine == "torch" else llamacpp_verdict(cfg, args.reference)
    except (ValueError, ApplianceError) as e:
        print(f"appliance check: {getattr(e, 'message', e)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict.report("on"), indent=2))
    else:
        print(f"device check: {verdict.describe()}")
        for d in verdict.differed:
            print(f"  differs: {d}")
    return {"agrees": 0, "differs": 1}.get(verdict.verdict, 2)


def llamacpp_verdict(cfg: config.EngineConfig, reference: Path | None = None):
    """The llama.cpp runner as placed for `cfg`, against llama.cpp's CPU backend on the same file
    (or on `reference`)."""
    from .engine.device_check import VerdictCache, checked
    from .engine.runners import make_runner
    from .models import resolve

    ref = resolve(cfg.model)
    runner = make_runner(dataclasses.replace(cfg, engine="llamacpp"), ref.path, ref.alias)
    try:
        return checked(runner, VerdictCache(), fresh=True, reference_path=reference)
    finally:
        runner.close()


def torch_verdict(cfg: config.EngineConfig, allow_cpu: bool = False):
    """The torch runner on its CUDA or ROCm device against the torch runner on the CPU (the same
    code on its CPU path): the start's check (device_check.checked_torch), measured afresh and
    remembered. `allow_cpu`: no refusal before loading where torch sees no GPU (tests, with the
    CPU standing in for the device)."""
    import torch

    from .engine.device_check import NO_GPU, VerdictCache, checked_torch
    from .engine.runners import make_runner
    from .errors import ModelLoadError
    from .models import resolve

    no_gpu = ModelLoadError("--engine torch: no CUDA or ROCm device here (torch.cuda.is_available() is false, or "
                            "--torch-device cpu): the torch runner's CPU path has nothing to be compared with")
    if not allow_cpu and (cfg.torch_device == "cpu" or not torch.cuda.is_available()):
        raise no_gpu
    ref = resolve(cfg.model)
    dev = make_runner(cfg, ref.path, ref.alias)
    try:
        verdict = checked_torch(dev, cfg, VerdictCache(), fresh=True)
    finally:
        dev.close()
    if verdict.verdict == "skipped" and verdict.why == NO_GPU:
        raise no_gpu
    return verdict
