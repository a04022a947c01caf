"""llama.cpp's devices, from ggml's backend registry in the shared libraries llama-cpp-python
ships (llama-cpp-python binds none of these): each device's name, kind, free and total memory
and buffer type, and the NULL-terminated `llama_model_tensor_buft_override` array that places
tensors by pattern (llama-cpp-python declares `tensor_buft_overrides` as a plain pointer).

A CPU build lists one device, "CPU"; a CUDA build adds "CUDA0", ...; Vulkan "Vulkan0"; ROCm
"ROCm0". The planner calls GPUs GPU0, GPU1, ... in the registry's order; `find(name)` takes
either spelling.

Whose memory a GPU holds: ggml says "igpu" for an integrated GPU, but a CPU-type Vulkan device
(Mesa's lavapipe, which llama.cpp lists when GGML_VK_VISIBLE_DEVICES names it) is "gpu" to it,
though it is software on the host's cores and its memory is host memory: the Vulkan loader's
device type says so (hostcheck.vulkan), and `host_memory` is true for both.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp as L

_LIB_DIR = Path(L.__file__).parent / "lib"
KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _soname(name: str) -> Path:
    """lib/NAME.so.0 where the build has it (what libllama links), else lib/NAME.so."""
    versioned = _LIB_DIR / f"{name}.so.0"
    return versioned if versioned.exists() else _LIB_DIR / f"{name}.so"


def libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml (the registry) and libggml-base (devices, buffer types), the very copies libllama
    loaded: by the soname it needs (libggml.so.0), for a wheel holds each library as separate
    files, not links, and loading libggml.so would load a second registry of its own (a device
    registered there, or a buffer type taken from it, is not llama.cpp's)."""
    reg = ctypes.CDLL(str(_soname("libggml")), mode=ctypes.RTLD_GLOBAL)
    base = ctypes.CDLL(str(_soname("libggml-base")), mode=ctypes.RTLD_GLOBAL)
    reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    reg.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    reg.ggml_backend_dev_get.restype = ctypes.c_void_p
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(base, fn).argtypes = [ctypes.c_void_p]
        getattr(base, fn).restype = ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    return reg, base


@dataclass(frozen=True)
class GgmlDevice:
    index: int                  # in the registry
    name: str                   # "CPU", "CUDA0", "Vulkan0"
    description: str
    kind: str                   # cpu | gpu | igpu | accel | meta
    free: int
    total: int
    buft: int                   # ggml_backend_buffer_type_t
    planner_name: str           # "CPU", "GPU0", ... (accelerators: their own name)
    host_memory: bool = False   # a GPU whose memory is the host's: integrated, or software on the CPU
    handle: int = 0             # ggml_backend_dev_t

    @property
    def remote(self) -> bool:
        """A worker's device, through llama.cpp's RPC backend (`appliance serve --rpc`)."""
        return self.name.startswith("RPC")

    @property
    def memory(self) -> str:
        """Whose memory, as the fit planner counts it: own (VRAM), gtt (an integrated GPU), host
        (software on the CPU)."""
        return "gtt" if self.kind == "igpu" else "host" if self.host_memory else "own"


def devices() -> list[GgmlDevice]:
    """Every device the loaded llama.cpp build offers, the CPU first."""
    reg, base = libs()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind, name = KINDS.get(base.ggml_backend_dev_type(dev), "other"), base.ggml_backend_dev_name(dev).decode()
        out.append(GgmlDevice(i, name, (base.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                              kind, free.value, total.value, base.ggml_backend_dev_buffer_type(dev),
                              "CPU" if kind == "cpu" else name, handle=dev))
    # llama.cpp lists a model's GPUs with the RPC workers' first (`main_gpu` counts them so)
    out.sort(key=lambda d: (d.kind != "cpu", not d.remote))
    gpus = [d for d in out if d.kind in ("gpu", "igpu")]
    out = [replace(d, planner_name=f"GPU{gpus.index(d)}") if d in gpus else d for d in out]
    return _mark_host_memory(out)


def _mark_host_memory(devs: list[GgmlDevice]) -> list[GgmlDevice]:
    """Each GPU with `host_memory` set: ggml's igpu, or a Vulkan device of the integrated or CPU
    type by the Vulkan loader's account (matched by name: ggml's description is Vulkan's
    deviceName). The loader is asked only when there is a Vulkan device."""
    types: dict[str, bool] = {}
    if any(d.name.startswith("Vulkan") for d in devs):
        from hostcheck.vulkan import probe_vulkan

        found = probe_vulkan()
        types = {v.name: v.host_memory for v in found} if isinstance(found, tuple) else {}
    return [replace(d, host_memory=d.kind == "igpu" or (d.kind == "gpu" and types.get(d.description, False)))
            for d in devs]


def llama_build():
    """What the installed llama.cpp can drive, for hostcheck and `appliance fit`: its version,
    whether it offloads to a GPU, and its devices (with whose memory each holds)."""
    from hostcheck.advice import LlamaBuild, LlamaDevice

    L.llama_backend_init()
    devs = devices()
    # llama_supports_gpu_offload is true for a build with the RPC backend alone: it has no GPU here
    local_gpu = any(d.kind in ("gpu", "igpu") and not d.remote for d in devs)
    return LlamaBuild(L.__version__, bool(L.llama_supports_gpu_offload()) and local_gpu,
                      tuple(LlamaDevice(d.name, d.description, d.free, d.total, d.kind, d.host_memory)
                            for d in devs))


def find(name: str, devs: list[GgmlDevice]) -> GgmlDevice | None:
    """A device by the planner's name (CPU, GPU0) or llama.cpp's (CUDA0, Vulkan0), any case."""
    low = name.lower()
    return next((d for d in devs if low in (d.name.lower(), d.planner_name.lower())), None)


class OverrideArray:
    """The NULL-terminated override array for `llama_model_params.tensor_buft_overrides`. Keep
    it alive as long as the model: llama.cpp keeps the pattern pointers."""

    def __init__(self, pairs: list[tuple[str, int]]) -> None:
        limit = L.llama_max_tensor_buft_overrides()
        if len(pairs) >= limit:
            raise ValueError(f"{len(pairs)} tensor overrides; llama.cpp takes at most {limit - 1}")
        self._patterns = [ctypes.create_string_buffer(p.encode()) for p, _ in pairs]
        self.array = (_Override * (len(pairs) + 1))()
        for i, ((_, buft), pattern) in enumerate(zip(pairs, self._patterns)):
            self.array[i].pattern = ctypes.cast(pattern, ctypes.c_char_p)
            self.array[i].buft = buft
        self.array[len(pairs)].pattern = None
        self.array[len(pairs)].buft = None

    @property
    def pointer(self) -> int:
        return ctypes.cast(self.array, ctypes.c_void_p).value
