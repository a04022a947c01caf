"""Where the llama.cpp runner puts the model: the fit planner's placement (`appliance.fit`) for
the devices this llama.cpp build offers, turned into `llama_model_params`.

One GPU holds the layers (`split_mode` none, `main_gpu`): the planner sizes one device, and
llama.cpp's default split across several GPUs would place what it did not plan. A placement
that does not fit is refused before llama.cpp allocates anything, with the numbers, unless no
GPU is involved (host memory only: llama.cpp memory-maps the weights and pages them in, slowly,
which is what it did before the planner).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as L
import psutil

from ...config import EngineConfig
from ...endpoints import parse_endpoints
from ...errors import ModelLoadError
from ...fit.devices import from_measured
from ...fit.model import ModelFacts, from_gguf
from ...fit.planner import FitRequest, Placement, plan, projector_of
from ...fit.render import render
from ...rope import positions_of
from . import ggml_devices

log = logging.getLogger("appliance.placement")

GPU_BUILD_HINT = ("reinstall llama-cpp-python with a GPU backend, e.g. CMAKE_ARGS=\"-DGGML_VULKAN=on\" "
                  "(or -DGGML_HIP=on, -DGGML_CUDA=on) pip install --force-reinstall --no-cache-dir "
                  "llama-cpp-python (the README has each line)")
GGML_KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}
# llama.cpp's lines at load: "load_tensors:      Vulkan0 model buffer size =    76.04 MiB"
BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class RunnerPlacement:
    placement: Placement
    facts: ModelFacts
    devices: list[ggml_devices.GgmlDevice]
    overrides: ggml_devices.OverrideArray | None   # kept alive as long as the model
    gpu: str | None = None                         # llama.cpp's name of the GPU holding the layers
    allocated: dict[str, dict[str, int]] = field(default_factory=dict)   # what llama.cpp said it allocated

    def identity(self) -> str:
        """What of the placement changes the computed bits, for the KV fingerprint: the devices
        this build computes on (a GPU build hands a big batch's matrix products to its GPU even
        with no layer there: llama.cpp's op offload), the GPU holding the layers, how many, and
        the tensor overrides (a tensor moved to llama.cpp's plain CPU buffer skips the repacked
        CPU kernels). Not the memory figures: they change from one start to the next."""
        devices = ",".join(f"{d.name}:{d.description}" for d in self.devices)
        overrides = ";".join(f"{p}={d}" for p, d in self.placement.overrides)
        return (f"devices={devices}|gpu={self.gpu}|n_gpu_layers={self.placement.n_gpu_layers}"
                f"|overrides={overrides}")

    def summary(self) -> dict:
        """The placement for /health: devices, layers, overrides and bytes."""
        p = self.placement.to_dict()
        p["llama_devices"] = [{"name": d.name, "description": d.description, "kind": d.kind,
                               "host_memory": d.host_memory, "free": d.free, "total": d.total}
                              for d in self.devices]
        p["allocated"] = self.allocated
        p["notes"] = p["notes"] + self.drift()
        return p

    def drift(self) -> list[str]:
        """Where llama.cpp put weights or KV on the GPU other than as planned (by more than 5% and
        a MiB): it falls back to host memory, silently, for a tensor larger than what the device
        says one buffer may hold. Nothing when its lines were not read."""
        use, got = self.placement.use.get(self.placement.gpu or ""), self.allocated.get(self.gpu or "")
        if use is None or not got:
            return []
        out = []
        for kind, planned in (("model", sum(use.weights.values())), ("KV", use.kv)):
            have = got.get(kind, 0)
            if abs(have - planned) > max(planned // 20, 2**20):
                out.append(f"llama.cpp allocated {have / 2**20:.1f} MiB of {kind} buffers on {self.gpu} where "
                           f"{planned / 2**20:.1f} MiB were planned: the rest is in host memory")
        return out

    def record_allocations(self, lines: list[str]) -> None:
        """Keep what llama.cpp said it allocated while loading: bytes by buffer (Vulkan0,
        CPU_Mapped, CPU_REPACK, ...) and kind (model, KV, compute), beside the planned bytes in
        /health. Its wording, not an API (llama.cpp has none for this): unmatched, it is empty."""
        for buf, kind, mib in BUFFER_LINE.findall("\n".join(lines)):
            got = self.allocated.setdefault(buf.partition("[")[0], {})   # RPC0[host:port]: the device's name
            got[kind] = got.get(kind, 0) + round(float(mib) * 2**20)


    def model_params(self, main_gpu: int) -> L.llama_model_params:
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = self.placement.n_gpu_layers
        mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
        mp.main_gpu = main_gpu
        if self.overrides is not None:
            mp.tensor_buft_overrides = self.overrides.pointer
        return mp


def _request(cfg: EngineConfig, facts: ModelFacts, devs: list[ggml_devices.GgmlDevice],
             gpu: ggml_devices.GgmlDevice | None, flash_attn: bool) -> FitRequest:
    overrides = []
    for pattern, name in cfg.tensor_overrides():
        dev = ggml_devices.find(name, devs)
        if dev is None:
            raise ModelLoadError(f"--override-tensor {pattern}={name}: this llama.cpp build has no device "
                                 f"{name!r} (it has {', '.join(d.name for d in devs)})")
        if dev.kind != "cpu" and dev != gpu:
            raise ModelLoadError(f"--override-tensor {pattern}={name}: only the main GPU ({gpu.name if gpu else 'none'}) "
                                 "holds tensors; choose it with --main-gpu")
        overrides.append((pattern, "CPU" if dev.kind == "cpu" else "GPU0"))
    ngl = {"auto": None, "all": facts.n_layer + 1}.get(cfg.n_gpu_layers)
    if ngl is None and cfg.n_gpu_layers != "auto":
        ngl = int(cfg.n_gpu_layers)
    n_cpu_moe = facts.n_layer if cfg.cpu_moe else cfg.n_cpu_moe
    return FitRequest(n_ctx=positions_of(cfg, facts.positions), n_slots=cfg.n_slots, kv_type=cfg.kv_type,
                      n_ubatch=min(cfg.n_ubatch, cfg.n_batch), flash_attn=flash_attn, n_gpu_layers=ngl,
                      n_cpu_moe=None if n_cpu_moe is None else min(n_cpu_moe, facts.n_layer),
                      overrides=tuple(overrides), projector=projector_of(cfg))


def _main_gpu(cfg: EngineConfig, devs: list[ggml_devices.GgmlDevice]) -> ggml_devices.GgmlDevice | None:
    gpus = [d for d in devs if d.kind in ("gpu", "igpu")]
    if not gpus:
        return None
    if cfg.main_gpu >= len(gpus):
        raise ModelLoadError(f"--main-gpu {cfg.main_gpu}: this llama.cpp build sees {len(gpus)} GPU(s) "
                             f"({', '.join(d.name for d in gpus)})")
    return gpus[cfg.main_gpu]


def _add_workers(cfg: EngineConfig) -> None:
    from . import ggml_rpc

    try:
        ggml_rpc.add_servers(parse_endpoints(cfg.rpc))
    except (ggml_rpc.RpcUnavailable, ggml_rpc.WorkerUnreachable) as e:
        raise ModelLoadError(f"--rpc {cfg.rpc}: {e}") from None


def place_model(cfg: EngineConfig, model_path: Path, flash_attn: bool) -> RunnerPlacement:
    """Plan the placement for this build's devices; raises ModelLoadError for an impossible one."""
    try:
        facts = from_gguf(model_path)
    except (OSError, ValueError) as e:
        # the words load_model uses for a file llama.cpp refuses: the header is read first now
        raise ModelLoadError(f"{model_path}: llama.cpp could not load this file as a GGUF model "
                             f"(its header: {e})") from None
    if cfg.rpc:   # the workers' devices join the registry before anything is planned or loaded
        _add_workers(cfg)
    devs = ggml_devices.devices()
    gpu = _main_gpu(cfg, devs)
    if gpu is None and cfg.n_gpu_layers not in ("auto", "0"):
        raise ModelLoadError(f"--n-gpu-layers {cfg.n_gpu_layers}: this llama.cpp build has no GPU backend "
                             f"(llama_supports_gpu_offload is false); {GPU_BUILD_HINT}")
    req = _request(cfg, facts, devs, gpu, flash_attn)
    mem = psutil.virtual_memory()
    fit_devices = from_measured(mem.total, mem.available,
                                [("GPU0", gpu.memory, gpu.free, gpu.total)] if gpu else [])
    placement = plan(facts, req, fit_devices)
    text = render(facts, placement)
    if not placement.fits and (gpu or req.overrides or req.n_cpu_moe is not None):
        raise ModelLoadError("the model does not fit as asked:\n" + text)
    (log.info if placement.fits else log.warning)("placement:\n%s", text.rstrip())
    for d in (d for d in devs if d.remote):
        held = f"{placement.n_gpu_layers} layers" if d == gpu and placement.gpu else "nothing"
        log.info("%s: RPC worker %s, %d MiB free of %d, holds %s", d.name, d.description, d.free // 2**20,
                 d.total // 2**20, held)
    cpu = next(d for d in devs if d.kind == "cpu")
    pairs = [(pattern, (cpu if name == "CPU" else gpu).buft) for pattern, name in placement.overrides]
    return RunnerPlacement(placement, facts, devs, ggml_devices.OverrideArray(pairs) if pairs else None,
                           gpu.name if gpu and placement.gpu else None)
