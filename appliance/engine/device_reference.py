"""The two sides of the device check (device_check.py) and the facts its verdict is keyed by.

The device side is the loaded runner itself: one forward of the check's text with a logits row
for every position. The CPU side is llama.cpp's CPU backend on the same file: a second model
given an empty device list (llama.cpp then creates no GPU backend at all, so neither the layers
nor its "op offload" of big batches reach the GPU) reading the file through its own mapping
(the page cache holds it once), and a context just big enough for the text.

The key: the model file's sha256 (remembered by path, size and mtime, so a restart does not read
70 GB again; for the torch runner's checkpoint directory, the sha256 of its files' listing),
llama.cpp's build (llama-cpp-python's version and the size and mtime of each of its native
libraries: a rebuild is another build; the torch runner's: device_check_torch.py), the device's
name and description, and the driver's version (the Vulkan loader's driverVersion, else the
kernel module's version).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ModelLoadError
from .runners.base import ModelRunner, Span


def device_logits(runner: ModelRunner, ids: Sequence[int], slot: int = 0) -> np.ndarray:
    """[T, V] logits of the text on the loaded runner (its slot is emptied after)."""
    try:
        return np.asarray(runner.forward([Span(slot, tuple(ids), 0, len(ids))])[0], dtype=np.float32)
    finally:
        runner.truncate(slot, 0)


def cpu_logits(path: Path, ids: Sequence[int], *, n_threads: int = 0, flash_attn: bool = False,
               kv_type: str = "f16") -> np.ndarray:
    """[T, V] logits of the text by llama.cpp's CPU backend alone on the GGUF at `path`."""
    return file_logits(path, ids, None, n_threads=n_threads, flash_attn=flash_attn, kv_type=kv_type)


def file_logits(path: Path, ids: Sequence[int], device: int | None, *, n_threads: int = 0,
                flash_attn: bool = False, kv_type: str = "f16") -> np.ndarray:
    """[T, V] logits of the text on the GGUF at `path`, loaded anew: every layer, the KV cache and
    big batches on `device` (a ggml_backend_dev_t), or with None on llama.cpp's CPU backend alone."""
    import llama_cpp as L

    from .runners.placement import GGML_KV_TYPES
    from .runners.vocab import init_backend

    init_backend()
    on_cpu = device is None
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0 if on_cpu else 2**31 - 1
    mp.split_mode, mp.main_gpu = L.LLAMA_SPLIT_MODE_NONE, 0
    devices = (ctypes.c_void_p * 2)(device, None)     # NULL-terminated; empty: the CPU alone
    mp.devices = ctypes.cast(devices, ctypes.c_void_p).value
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ModelLoadError(f"{path}: llama.cpp {'CPU backend ' if on_cpu else ''}could not load the file for the "
                             "device check")
    n = len(ids)
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = max(256, n), n, n, 1
        threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = GGML_KV_TYPES[kv_type]
        cp.offload_kqv = cp.op_offload = not on_cpu
        cp.no_perf = True
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise ModelLoadError(f"{path}: llama.cpp could not create a context for the device check")
        try:
            return _decode_all(L, ctx, model, ids)
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model)


def _decode_all(L, ctx, model, ids: Sequence[int]) -> np.ndarray:
    n, n_vocab = len(ids), L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n, 0, 1)
    try:
        for i, tok in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        batch.n_tokens = n
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise ModelLoadError(f"the device check's CPU side: llama_decode failed with code {rc}")
        rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (n_vocab,)).copy() for i in range(n)]
        return np.stack(rows)
    finally:
        L.llama_batch_free(batch)


# -- the key ------------------------------------------------------------------------------------

def llama_build() -> str:
    """llama.cpp's build as the verdict's key holds it: llama-cpp-python's version and a digest of
    its native libraries' names, sizes and mtimes (a rebuild with another backend or another
    llama.cpp is another string)."""
    import llama_cpp as L

    lib_dir = Path(L.__file__).parent / "lib"
    h = hashlib.sha256()
    for f in sorted(lib_dir.glob("*.so*")) if lib_dir.is_dir() else []:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return f"llama-cpp-python {L.__version__} (libraries {h.hexdigest()[:12]})"


def driver_version(name: str, description: str) -> str:
    """The driver behind a device: the Vulkan loader's driverVersion for a Vulkan device (matched
    by its description, which is Vulkan's deviceName), else the kernel module's version."""
    if name.startswith("Vulkan"):
        from hostcheck.vulkan import probe_vulkan

        found = probe_vulkan()
        for v in found if isinstance(found, tuple) else ():
            if v.name == description:
                return f"Vulkan {v.api_version}, driver {v.driver_version}"
    for module in ("nvidia", "amdgpu"):
        try:
            return f"{module} {Path(f'/sys/module/{module}/version').read_text().strip()}"
        except OSError:
            continue
    return "unknown"


def model_sha256(path: Path, memo_dir: Path | None) -> str:
    """The file's sha256, remembered in `memo_dir` by its real path, size and mtime. A checkpoint
    directory (the torch runner's): the sha256 of a listing of its files, each one's path within
    it, size and mtime in name order: not of their contents, so a file rewritten with the same
    size and mtime is the same model to it, and a copied directory (new mtimes) another."""
    if path.is_dir():
        return listing_sha256(path)
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = memo_dir / "sha256.json" if memo_dir is not None else None
    known: dict[str, str] = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known, dict) and isinstance(known.get(key), str):
            return known[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: digest}))
            os.replace(tmp, memo)
        except OSError:
            pass
    return digest


def listing_sha256(directory: Path) -> str:
    """The sha256 of a directory's files listed by relative path, size and mtime (ns), sorted."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(directory).as_posix()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
