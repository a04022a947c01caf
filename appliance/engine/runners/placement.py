"""Where the llama.cpp runner puts the model: the fit planner's placement (`appliance.fit`) for
the devices this llama.cpp build offers, turned into `llama_model_params`.

One GPU holds the layers (`split_mode` none, `main_gpu`) unless workers are named (`--rpc`) or
`--tensor-split` is given: then the layers are split over every GPU llama.cpp would use (the
workers' devices first, then this host's), and the model is given that device list and the
planner's shares explicitly (`devices`, `tensor_split`), so that llama.cpp places exactly what
was planned. A placement that does not fit is refused before llama.cpp allocates anything, with
the numbers, unless no GPU is involved (host memory only: llama.cpp memory-maps the weights and
pages them in, slowly, which is what it did before the planner).
"""
from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as L
import psutil

from ...config import EngineConfig
from ...endpoints import parse_endpoints, parse_split
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
    gpu: str | None = None                         # llama.cpp's name of the (first) GPU holding layers
    allocated: dict[str, dict[str, int]] = field(default_factory=dict)   # what llama.cpp said it allocated
    names: dict[str, str] = field(default_factory=dict)   # the planner's GPU0, GPU1... -> llama.cpp's names
    split: list[ggml_devices.GgmlDevice] | None = None    # the devices of a layer split (None: one GPU)
    _arrays: tuple = ()                                   # the ctypes arrays model_params points into

    def identity(self) -> str:
        """What of the placement changes the computed bits, for the KV fingerprint: the devices
        this build computes on (a GPU build hands a big batch's matrix products to its GPU even
        with no layer there: llama.cpp's op offload), the GPU holding the layers, how many, and
        the tensor overrides (a tensor moved to llama.cpp's plain CPU buffer skips the repacked
        CPU kernels). Not the memory figures: they change from one start to the next."""
        devices = ",".join(f"{d.name}:{d.description}" for d in self.devices)
        overrides = ";".join(f"{p}={d}" for p, d in self.placement.overrides)
        # a split by the layers each device holds, not by its shares (by default each device's free
        # memory, which changes from one start to the next)
        split = ",".join(f"{self.names.get(g, g)}:{sum(1 for d in self.placement.layers.values() if d == g)}"
                         for g in self.placement.split)
        return (f"devices={devices}|gpu={self.gpu}|n_gpu_layers={self.placement.n_gpu_layers}"
                f"|overrides={overrides}" + (f"|split={split}" if split else ""))

    def summary(self) -> dict:
        """The placement for /health: devices, layers, overrides and bytes."""
        p = self.placement.to_dict()
        p["llama_devices"] = [{"name": d.name, "description": d.description, "kind": d.kind,
                               "host_memory": d.host_memory, "free": d.free, "total": d.total}
                              for d in self.devices]
        p["allocated"] = self.allocated
        p["names"] = self.names
        p["notes"] = p["notes"] + self.drift()
        return p

    def drift(self) -> list[str]:
        """Where llama.cpp put weights or KV on a GPU other than as planned (by more than 5% and a
        MiB): it falls back to host memory, silently, for a tensor larger than what the device says
        one buffer may hold. Nothing for a device whose lines were not read."""
        out = []
        for planner_name, name in self.names.items():
            use, got = self.placement.use.get(planner_name), self.allocated.get(name)
            if use is None or not got:
                continue
            for kind, planned in (("model", sum(use.weights.values())), ("KV", use.kv)):
                have = got.get(kind, 0)
                if abs(have - planned) > max(planned // 20, 2**20):
                    out.append(f"llama.cpp allocated {have / 2**20:.1f} MiB of {kind} buffers on {name} where "
                               f"{planned / 2**20:.1f} MiB were planned: the rest is in host memory")
        return out

    def record_allocations(self, lines: list[str]) -> None:
        """Keep what llama.cpp said it allocated while loading: bytes by device buffer (Vulkan0,
        CPU_Mapped, CPU_REPACK, RPC1, ...) and kind (model, KV, compute), beside the planned bytes
        in /health. Its wording, not an API (llama.cpp has none for this): unmatched, it is empty."""
        for buf, kind, mib in BUFFER_LINE.findall("\n".join(lines)):
            got = self.allocated.setdefault(self._device_of(buf), {})
            got[kind] = got.get(kind, 0) + round(float(mib) * 2**20)

    def _device_of(self, buffer: str) -> str:
        """A buffer's device: a worker's buffers are named RPC<i>[HOST:PORT], i counting that
        worker's devices, while its devices are RPC<n>, n counting every worker's."""
        name, _, rest = buffer.partition("[")
        endpoint = rest.rstrip("]")
        if not endpoint or not name[3:].isdigit():
            return name
        mine = [d.name for d in self.devices if d.remote and d.description == endpoint]
        return mine[int(name[3:])] if int(name[3:]) < len(mine) else name

    def model_params(self, main_gpu: int) -> L.llama_model_params:
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = self.placement.n_gpu_layers
        mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
        mp.main_gpu = main_gpu
        if self.split is not None:        # these devices, in this order, with the planned shares
            shares = [self.placement.split.get(f"GPU{i}", 1.0) for i in range(len(self.split))]
            devs = (ctypes.c_void_p * (len(self.split) + 1))(*[d.handle for d in self.split], None)
            split = (ctypes.c_float * L.llama_max_devices())(*shares)
            self._arrays = (devs, split)
            mp.split_mode, mp.main_gpu = L.LLAMA_SPLIT_MODE_LAYER, 0
            mp.devices = ctypes.cast(devs, ctypes.c_void_p).value
            mp.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
        if self.overrides is not None:
            mp.tensor_buft_overrides = self.overrides.pointer
        return mp


def _request(cfg: EngineConfig, facts: ModelFacts, devs: list[ggml_devices.GgmlDevice],
             gpus: list[ggml_devices.GgmlDevice], flash_attn: bool) -> FitRequest:
    overrides = []
    for pattern, name in cfg.tensor_overrides():
        dev = ggml_devices.find(name, devs)
        if dev is None:
            raise ModelLoadError(f"--override-tensor {pattern}={name}: this llama.cpp build has no device "
                                 f"{name!r} (it has {', '.join(d.name for d in devs)})")
        if dev.kind != "cpu" and dev not in gpus:
            raise ModelLoadError(f"--override-tensor {pattern}={name}: only the GPUs holding layers "
                                 f"({', '.join(d.name for d in gpus) or 'none'}) hold tensors; choose the GPU "
                                 "with --main-gpu")
        overrides.append((pattern, "CPU" if dev.kind == "cpu" else f"GPU{gpus.index(dev)}"))
    ngl = {"auto": None, "all": facts.n_layer + 1}.get(cfg.n_gpu_layers)
    if ngl is None and cfg.n_gpu_layers != "auto":
        ngl = int(cfg.n_gpu_layers)
    n_cpu_moe = facts.n_layer if cfg.cpu_moe else cfg.n_cpu_moe
    split = parse_split(cfg.tensor_split) if cfg.tensor_split else ()
    if split and len(split) != len(gpus):
        raise ModelLoadError(f"--tensor-split {cfg.tensor_split}: one share per GPU, and the layers would be split "
                             f"over {len(gpus)} ({', '.join(d.name for d in gpus) or 'none'})")
    return FitRequest(n_ctx=positions_of(cfg, facts.positions), n_slots=cfg.n_slots, kv_type=cfg.kv_type,
                      n_ubatch=min(cfg.n_ubatch, cfg.n_batch), flash_attn=flash_attn, n_gpu_layers=ngl,
                      n_cpu_moe=None if n_cpu_moe is None else min(n_cpu_moe, facts.n_layer),
                      overrides=tuple(overrides), projector=projector_of(cfg), tensor_split=split)


def split_devices(devs: list[ggml_devices.GgmlDevice]) -> list[ggml_devices.GgmlDevice]:
    """The GPUs llama.cpp splits layers over by default: the RPC workers' devices first, then this
    host's GPUs, its integrated ones only where it has no discrete one (llama.cpp's
    `llama_prepare_model_devices`)."""
    local = [d for d in devs if d.kind == "gpu" and not d.remote]
    return [d for d in devs if d.remote] + (local or [d for d in devs if d.kind == "igpu"])


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
                             f"(ggml lists no GPU device); {GPU_BUILD_HINT}")
    split = split_devices(devs) if cfg.rpc or cfg.tensor_split else None
    gpus = split if split is not None else [gpu] if gpu else []
    req = _request(cfg, facts, devs, gpus, flash_attn)
    mem = psutil.virtual_memory()
    fit_devices = from_measured(mem.total, mem.available,
                                [(f"GPU{i}", d.memory, d.free, d.total, d.remote) for i, d in enumerate(gpus)])
    placement = plan(facts, req, fit_devices)
    text = render(facts, placement)
    if not placement.fits and (gpu or req.overrides or req.n_cpu_moe is not None):
        raise ModelLoadError("the model does not fit as asked:\n" + text)
    (log.info if placement.fits else log.warning)("placement:\n%s", text.rstrip())
    names = {f"GPU{i}": d.name for i, d in enumerate(gpus)}
    output = next((placement.where[t.name] for t in facts.tensors if t.role == "output"), None)
    for i, d in enumerate(gpus):
        held = sorted(layer for layer, where in placement.layers.items() if where == f"GPU{i}")
        held_text = f"layers {held[0]}-{held[-1]}" if held else "no layer"
        log.info("%s%s: %d MiB free of %d, holds %s%s", d.name, f" (RPC worker {d.description})" if d.remote else "",
                 d.free // 2**20, d.total // 2**20, held_text,
                 " and the output" if output == f"GPU{i}" else "")
    cpu = next(d for d in devs if d.kind == "cpu")
    by_name = {"CPU": cpu, **{f"GPU{i}": d for i, d in enumerate(gpus)}}
    pairs = [(pattern, by_name[name].buft) for pattern, name in placement.overrides]
    return RunnerPlacement(placement, facts, devs, ggml_devices.OverrideArray(pairs) if pairs else None,
                           names.get(placement.gpu or "") if placement.gpu else None, names=names, split=split)
