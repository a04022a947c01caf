"""llama.cpp's RPC backend, through its C API (llama-cpp-python binds none of it, and its
high-level `rpc_servers` argument is ignored in 0.3.36): the worker side serves this machine's
ggml devices over the RPC protocol (`ggml_backend_rpc_start_server`), the head side adds a
worker's devices to ggml's registry (`ggml_backend_rpc_add_server`, then
`ggml_backend_register`), as llama.cpp's rpc-server and llama-server's `add_rpc_devices` do.
Both functions are found through the "RPC" registration's proc addresses, so a build without
the backend is told apart and refused with how to build one.

The protocol has no authentication and no encryption: a worker runs whatever graph a client
sends and holds what it is given. It belongs on a private link.

llama.cpp aborts the process (GGML_ABORT) when a worker it is told of does not answer, so the
head connects to each address itself first and refuses with the address.
"""
from __future__ import annotations

import ctypes
import socket

from ...endpoints import Endpoint
from .ggml_devices import libs

BUILD_HINT = ("this llama-cpp-python has no RPC backend; build one with "
              "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --no-cache-dir --force-reinstall --no-deps "
              "llama-cpp-python==0.3.36 (scripts/rpc_check.sh does it into .venv-rpc)")

_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


_REGISTERED: set = set()   # endpoints whose devices this process has registered


class RpcUnavailable(RuntimeError):
    """This llama.cpp build cannot speak the RPC protocol."""


class WorkerUnreachable(RuntimeError):
    """A worker named with --rpc did not answer."""


def _proc(name: str, functype):
    """A function of the RPC backend, by the registration's proc address (RpcUnavailable if none)."""
    reg, _ = libs()
    reg.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    reg.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    rpc = reg.ggml_backend_reg_by_name(b"RPC")
    if not rpc:
        raise RpcUnavailable(BUILD_HINT)
    base = ctypes.CDLL(None)   # ggml-base is loaded globally by _libs
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    address = base.ggml_backend_reg_get_proc_address(rpc, name.encode())
    if not address:
        raise RpcUnavailable(f"the RPC backend has no {name}; {BUILD_HINT}")
    return functype(address)


def available() -> str | None:
    """None when this build has the RPC backend, else why not (for a test's skip reason)."""
    try:
        _proc("ggml_backend_rpc_start_server", _START_SERVER)
    except (RpcUnavailable, OSError) as e:
        return str(e)
    return None


def start_server(endpoint: Endpoint, device_indices: list[int], cache_dir: str | None,
                 n_threads: int) -> None:
    """Serve the registry's devices at these indices at `endpoint`; returns only when the
    server cannot start (it prints why: llama.cpp reports on stderr, returns nothing)."""
    fn = _proc("ggml_backend_rpc_start_server", _START_SERVER)
    reg, _ = libs()
    devs = (ctypes.c_void_p * len(device_indices))(*[reg.ggml_backend_dev_get(i) for i in device_indices])
    fn(str(endpoint).encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devs), devs)


def check_reachable(endpoint: Endpoint, timeout_s: float = 3.0) -> None:
    """Connect once, so that a worker that is not there is a refusal naming it, not llama.cpp's abort."""
    try:
        socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s).close()
    except OSError as e:
        raise WorkerUnreachable(f"RPC worker {endpoint} does not answer: {e.strerror or e}") from None


def add_servers(endpoints: tuple[Endpoint, ...]) -> None:
    """Register each worker's devices in ggml's registry (before a model loads: llama.cpp places
    layers on every registered device). Each worker is checked reachable first."""
    add = _proc("ggml_backend_rpc_add_server", _ADD_SERVER)
    for ep in endpoints:
        check_reachable(ep)
    reg, _ = libs()
    reg.ggml_backend_register.argtypes = [ctypes.c_void_p]
    reg.ggml_backend_register.restype = None
    for ep in endpoints:
        if ep in _REGISTERED:      # registering twice would list its devices twice
            continue
        worker = add(str(ep).encode())
        if not worker:
            raise WorkerUnreachable(f"RPC worker {ep} offers no device")
        reg.ggml_backend_register(worker)
        _REGISTERED.add(ep)
