"""The llama.cpp runner, on llama-cpp-python's low-level API.

One llama context holds `n_slots` sequences (one sequence id per slot), by default one KV stream
of n_ctx positions each (`kv_unified` off: four streams decoding at once measured 1.2x faster
than one shared buffer here); with `--kv-unified` one buffer of n_ctx cells that any sequence
may fill (the scheduler counts its cells, sched/kv_pool.py). Logits are kept only for the rows
the scheduler asks for.

Batch invariance: llama.cpp splits a multi-sequence batch into micro-batches that take the
same number of tokens from every sequence, so mixing one slot's 512-token prompt chunk with
another slot's one-token decode would cut the chunk differently from a run where it is alone,
and change its KV and so its output. `forward` therefore issues one `llama_decode` for all the
one-token spans together (decode rows, computed row by row) and one per prompt chunk: a
request's tokens are computed in the same shapes whatever else is running.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp as L

from ...compute_settings import LlamaCppSettings
from ...config import EngineConfig
from ...errors import EngineFailure, ModelLoadError
from ...fit.gguf_header import nbytes
from ...models import file_fingerprint
from ...rope import ModelRope, RopeScaling, served
from . import llamacpp_mtp, mtp_source
from .llamacpp_fixed import FixedShape
from .llamacpp_lora import Adapters, one_set
from .base import RunnerInfo, Span
from .vision import Projector
from .placement import GGML_KV_TYPES, place_model
from .vocab import TextMethods, Vocab, captured_log, init_backend, load_model, meta

log = logging.getLogger("appliance.llamacpp")

# A saved state is a few hundred MB for a long context: llama.cpp reads and writes it in place.
# The C API allows writing into a bytes object "just created using PyBytes_FromStringAndSize(NULL,
# size)" (PyBytes_AsString's documentation), before anyone else holds it.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def _u8(blob: bytes) -> ctypes._Pointer:
    """A pointer to a bytes object's own buffer (no copy); valid while `blob` lives."""
    return ctypes.cast(_bytes_data(blob), ctypes.POINTER(ctypes.c_uint8))


def kv_bytes(model: L.llama_model_p, kv_type: str, positions: int) -> int:
    """K and V of the KV type for every layer and position: what llama.cpp allocates for a pool
    of `positions` (a head may be wider than n_embd / n_head: qwen3 says so in attention.key_length)."""
    n_layer = L.llama_model_n_layer(model)
    n_head = L.llama_model_n_head(model)
    n_head_kv = L.llama_model_n_head_kv(model)
    arch = meta(model, "general.architecture")
    k_dim = int(meta(model, f"{arch}.attention.key_length") or L.llama_model_n_embd(model) // n_head)
    v_dim = int(meta(model, f"{arch}.attention.value_length") or k_dim)
    return nbytes(kv_type.upper(), positions * n_layer * n_head_kv * (k_dim + v_dim))


ROPE_TYPES = {"none": L.LLAMA_ROPE_SCALING_TYPE_NONE, "linear": L.LLAMA_ROPE_SCALING_TYPE_LINEAR,
              "yarn": L.LLAMA_ROPE_SCALING_TYPE_YARN}


def set_rope(cp: L.llama_context_params, r: RopeScaling) -> None:
    """The resolved rotation into llama_context_params, every field given (none left to the model)."""
    cp.rope_scaling_type = ROPE_TYPES[r.kind]
    cp.rope_freq_base, cp.rope_freq_scale = r.freq_base, r.freq_scale
    cp.yarn_ext_factor, cp.yarn_attn_factor = r.ext_factor, r.attn_factor
    cp.yarn_beta_fast, cp.yarn_beta_slow, cp.yarn_orig_ctx = r.beta_fast, r.beta_slow, r.orig_ctx


class LogitsRows:
    """Copies of the rows of llama.cpp's logits buffer. numpy's `ctypeslib.as_array` builds a
    ctypes array type and a cast on every call: ~50 us between two decodes here, five times the
    copy itself, on every decode step. A view made once for each row address llama.cpp hands
    out is kept, and read only at once after llama.cpp gave that address for a row of n_vocab
    floats (the buffer may move; a new address gets a new view)."""

    MAX_VIEWS = 4096

    def __init__(self, n_vocab: int) -> None:
        self.row_type = ctypes.c_float * n_vocab
        self.views: dict[int, np.ndarray] = {}

    def copy(self, ptr: ctypes._Pointer) -> np.ndarray:
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        view = self.views.get(addr)  # type: ignore[arg-type]
        if view is None:
            if len(self.views) >= self.MAX_VIEWS:
                self.views.clear()
            view = self.views[addr] = np.frombuffer(self.row_type.from_address(addr), np.float32)  # type: ignore[index]
        return view.copy()


class LlamaCppRunner(FixedShape, TextMethods):
    def __init__(self, cfg: EngineConfig, model_path: Path, model_name: str) -> None:
        init_backend()
        s = cfg.llamacpp()
        self.kv_type = cfg.kv_type
        if self.kv_type != "f16" and not s.flash_attn:
            log.info("--kv-type %s: turning on flash attention, which llama.cpp needs for a quantised V cache",
                     self.kv_type)
            s = dataclasses.replace(s, flash_attn=True)
        self.llamacpp = s
        self.placed = place_model(cfg, model_path, s.flash_attn)   # refuses an impossible placement first
        self.head_source = mtp_source.choose(cfg, model_path)       # and a --mtp-model that does not fit
        with captured_log() as said:
            try:
                mp = self.placed.model_params(cfg.main_gpu)
                mp.load_mtp = self.head_source.bundled   # its next-n layers, where its GGUF has the head that drafts
                self.model = load_model(model_path, params=mp)
                self._model_params = mp           # a sidecar head is placed as the model's own block would be
                # read before the context: llama.cpp rewrites n_ctx_train for a custom YaRN scale
                n_ctx_train = L.llama_model_n_ctx_train(self.model)
                cp = self._context(cfg, model_path, s)
                self.adapters = self._adapters(cfg)
                self._mtp_check(cp)
            except ModelLoadError as e:      # with llama.cpp's reason: a buffer a device did not give
                raise ModelLoadError(e.message + said.why()) from None
        self.placed.record_allocations(said.lines)
        for note in self.placed.drift():
            log.warning("placement: %s", note)
        self.text = Vocab(self.model)
        self.n_vocab = self.text.n_vocab
        self.rows = LogitsRows(self.n_vocab)
        n_ctx = cfg.n_ctx or n_ctx_train
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = s.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, cfg.n_slots)
        self.projector = self._projector(cfg, s)
        n_ctx_seq = L.llama_n_ctx_seq(self.ctx)
        pool = n_ctx_seq if cfg.kv_unified else n_ctx_seq * cfg.n_slots
        self.info = RunnerInfo(
            backend="llama.cpp", model_path=str(model_path), model_name=model_name,
            arch=meta(self.model, "general.architecture") or "unknown",
            n_ctx=min(n_ctx, n_ctx_seq), n_ctx_train=n_ctx_train, n_slots=cfg.n_slots,
            **self.text.facts(),
            kv_bytes=kv_bytes(self.model, self.kv_type, pool), kv_unified=cfg.kv_unified,
            settings={**s.as_dict(), "kv_type": self.kv_type, "kv_unified": cfg.kv_unified, "llama_cpp_python": L.__version__,
                      "rope": self.rope.as_dict(), "context": self.rope.describe(n_ctx, n_ctx_train, "in the pool the slots share" if cfg.kv_unified else "per slot")},
            fingerprint=file_fingerprint(model_path),
            placement=self.placed.summary(), adapters=self.adapters.listed,
        )
        self.info.settings.update(self._extras())

    def _extras(self) -> dict[str, object]:
        """The settings of what is loaded beside the model: the projector, the LoRA adapters."""
        extras: dict[str, object] = {}
        if self.projector is not None:
            extras["mmproj"] = self.projector.describe()
        if self.adapters.listed:
            extras["lora"] = [f"{a.path}:{a.scale:g}" for a in self.adapters.listed]
        return extras

    def _projector(self, cfg: EngineConfig, s: LlamaCppSettings) -> Projector | None:
        """--mmproj's projector beside the model (vision.py): images in a prompt."""
        if cfg.mmproj is None:
            return None
        try:
            return Projector(Path(cfg.mmproj), self.model, n_threads=s.n_threads, use_gpu=cfg.mmproj_offload,
                             flash_attn=s.flash_attn, n_batch=self.n_batch, n_ubatch=s.n_ubatch)
        except ModelLoadError:
            self.close()
            raise

    def _context(self, cfg: EngineConfig, model_path: Path, s: LlamaCppSettings) -> L.llama_context_params:
        """The llama context: one KV stream per slot (or one for all), the batch shapes, threads, KV type."""
        arch = meta(self.model, "general.architecture") or ""
        try:
            n_ctx, self.rope = served(cfg, ModelRope.from_meta(lambda k: meta(self.model, k), arch))
        except ValueError as e:
            L.llama_model_free(self.model)
            raise ModelLoadError(f"{model_path}: {e}") from None
        cp = L.llama_context_default_params()
        set_rope(cp, self.rope)
        cp.n_ctx = n_ctx * (1 if cfg.kv_unified else cfg.n_slots)
        cp.n_seq_max = cfg.n_slots
        cp.kv_unified = cfg.kv_unified
        cp.n_batch, cp.n_ubatch = s.n_batch, s.n_ubatch
        cp.n_threads, cp.n_threads_batch = s.n_threads, s.n_threads_batch
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s.flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.type_k = cp.type_v = GGML_KV_TYPES[self.kv_type]
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise ModelLoadError(f"{model_path}: llama.cpp could not create a context of "
                                 f"{1 if cfg.kv_unified else cfg.n_slots} x {n_ctx} positions")
        return cp

    def _adapters(self, cfg: EngineConfig) -> Adapters:
        """--lora's adapters, loaded beside the model (llamacpp_lora.py); a file llama.cpp refuses
        frees what was loaded and fails the start."""
        try:
            return Adapters(self.model, cfg.lora_files())
        except ModelLoadError:
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            raise

    def _mtp_check(self, cp: L.llama_context_params) -> None:
        """Whether the model has a next-n (MTP) head llama.cpp can run, in its GGUF or a sidecar
        (`head_source`, mtp_source.py; `mtp_refusal` says why not); `start_mtp` loads a sidecar and
        creates the head's context once speculation has chosen it."""
        self.nextn: llamacpp_mtp.NextnHead | None = None
        self.head_model: L.llama_model_p | None = None   # a sidecar's, loaded by start_mtp
        self.hidden: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._mtp_params = cp
        self.mtp_refusal = self.head_source.refusal

    def start_mtp(self) -> llamacpp_mtp.NextnHead:
        """The model's head in an MTP context beside the target's (its slots, context, threads
        and KV type), run by the model's own weights or a sidecar's (loaded now, with
        `load_mtp`); the target keeps the trunk's hidden row of every token from now on
        (`hidden`, after each forward). Computing those rows changes no logit: every row's last
        block runs, and the logits rows asked for are the same rows (tests/engine/test_mtp.py
        compares a server with the head against one without)."""
        assert self.mtp_refusal is None, self.mtp_refusal
        if self.nextn is None:
            if self.head_source.path is not None:
                self._model_params.load_mtp = True
                with captured_log() as said:
                    try:
                        self.head_model = load_model(self.head_source.path, params=self._model_params)
                    except ModelLoadError as e:
                        raise ModelLoadError(f"the MTP head's file: {e.message}{said.why()}") from None
            self.nextn = llamacpp_mtp.NextnHead(self.head_model or self.model, self._mtp_params, self.n_batch, self.ctx)
            llamacpp_mtp.keep_target_rows(self.ctx)
            self.info.settings["mtp"] = self.head_source.name
        return self.nextn

    def kv_fingerprint(self) -> str:
        """What a saved state's validity depends on: the model file, the context, the KV type,
        llama.cpp's build, the batch shapes, kernels and threads, and the placement (the devices
        and which layers and tensors each computes) that change the computed KV: a state saved
        under other settings would not restore bit for bit."""
        s = self.llamacpp
        return "|".join([self.info.fingerprint, f"n_ctx={self.info.n_ctx}", f"kv={self.kv_type}",
                         f"llama_cpp_python={L.__version__}", f"n_batch={s.n_batch}", f"n_ubatch={s.n_ubatch}",
                         f"flash_attn={s.flash_attn}", f"n_threads={s.n_threads}",
                         f"n_threads_batch={s.n_threads_batch}", self.rope.identity(), self.placed.identity(),
                         *(["kv_unified"] if self.info.kv_unified else []),
                         *([f"decode_rows={self.decode_rows}"] if self.decode_rows else []),
                         *([f"mmproj={self.projector.fingerprint}"] if self.projector else [])])

    # -- compute -------------------------------------------------------------------------
    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(spans)
        self.adapters.apply(self.ctx, one_set(spans))
        if self.nextn is not None:
            self.hidden = []
        fixed = self._fixed_forward(spans, out)   # decode spans at the fixed shape (llamacpp_fixed.py), if on
        singles = [i for i, s in enumerate(spans) if len(s.tokens) == 1 and s.tokens[0] >= 0 and i not in fixed]
        if singles:
            self._decode([spans[i] for i in singles], [out, singles])
        for i, s in enumerate(spans):
            if i in fixed:
                continue
            if self.projector is not None and min(s.tokens) < 0:   # image rows: vision.py
                out[i] = self.projector.forward(self.ctx, s, self._decoded)
            elif len(s.tokens) > 1:
                self._decode([s], [out, [i]])
        return out  # type: ignore[return-value]

    def _decoded(self, span: Span) -> np.ndarray:
        got: list[np.ndarray | None] = [None]
        self._decode([span], [got, [0]])
        return got[0]  # type: ignore[return-value]

    def _decode(self, spans: Sequence[Span], sink: list) -> None:
        """One llama_decode per n_batch tokens; logits rows copied out before the next call."""
        out, where = sink
        rows: list[tuple[int, int]] = []   # (span index in `spans`, batch row)
        b, n = self.batch, 0
        pieces = []
        for k, s in enumerate(spans):
            for j, tok in enumerate(s.tokens):
                if n == self.n_batch:
                    pieces.append(self._run(n, rows))
                    rows, n = [], 0
                want = j >= len(s.tokens) - s.n_logits
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, s.start_pos + j, 1
                b.seq_id[n][0], b.logits[n] = s.slot, want
                if want:
                    rows.append((k, n))
                n += 1
        pieces.append(self._run(n, rows))
        per_span: dict[int, list[np.ndarray]] = {}
        for got in pieces:
            for k, row in got:
                per_span.setdefault(k, []).append(row)
        for k, s in enumerate(spans):
            got = per_span.get(k, [])
            if len(got) == 1:
                out[where[k]] = got[0][None, :]  # the usual case: one row, no second copy
            else:
                out[where[k]] = np.stack(got) if got else np.empty((0, self.n_vocab), np.float32)

    def _run(self, n: int, rows: list[tuple[int, int]]) -> list[tuple[int, np.ndarray]]:
        self.batch.n_tokens = n
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc} on a batch of {n} tokens")
        if self.nextn is not None:   # (slots, positions, tokens, trunk rows) of every batch row
            b = self.batch
            self.hidden.append((np.array([b.seq_id[i][0] for i in range(n)]), np.ctypeslib.as_array(b.pos, (n,)).copy(),
                                np.ctypeslib.as_array(b.token, (n,)).copy(),
                                llamacpp_mtp.target_rows(self.ctx, n, self.nextn.n_embd)))
        return [(k, self.rows.copy(L.llama_get_logits_ith(self.ctx, r))) for k, r in rows]

    # -- KV ------------------------------------------------------------------------------
    def truncate(self, slot: int, n_keep: int) -> None:
        L.llama_memory_seq_rm(self.mem, slot, n_keep, -1)

    def kv_used(self, slot: int) -> int:
        """Positions the slot holds: its KV is always positions 0..n-1 (spans continue it, cuts drop a tail)."""
        return L.llama_memory_seq_pos_max(self.mem, slot) + 1

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        # With a stream per slot (kv_unified off) llama.cpp's seq_cp between streams only copies
        # whole buffers: a partial range hits a GGML_ASSERT that aborts the process. Copy the
        # sequence's state instead, then drop what is past the prefix. In one unified buffer
        # seq_cp tags the same cells with dst too: no copy, no memory.
        if src == dst:
            self.truncate(dst, n)
            return
        L.llama_memory_seq_rm(self.mem, dst, -1, -1)
        if n <= 0:
            return
        if self.info.kv_unified:
            L.llama_memory_seq_cp(self.mem, src, dst, 0, n)
            return
        self.restore(dst, self.save(src))
        self.truncate(dst, n)

    def save(self, slot: int) -> bytes:
        """The slot's state, written by llama.cpp straight into the bytes object returned. A
        spill runs on the step path: zeroing a ctypes buffer and copying it into bytes took
        ~95 ms of a 47 MB state's save against ~13 ms for llama.cpp's own copy (the whole save
        170 ms before, 80 ms now, on a loaded 2-core host)."""
        size = L.llama_state_seq_get_size(self.ctx, slot)
        if size == 0:
            return b""
        blob = _new_bytes(None, size)  # uninitialised; ours alone until returned
        n = L.llama_state_seq_get_data(self.ctx, _u8(blob), size, slot)
        return blob if n == size else blob[:n]

    def restore(self, slot: int, blob: bytes) -> None:
        L.llama_memory_seq_rm(self.mem, slot, -1, -1)
        blob = bytes(blob)  # a no-op for bytes; a copy of any other buffer
        if L.llama_state_seq_set_data(self.ctx, _u8(blob), len(blob), slot) == 0:
            raise EngineFailure(f"llama.cpp refused a saved state of {len(blob)} bytes for slot {slot}")

    def close(self) -> None:
        if getattr(self, "projector", None) is not None:
            self.projector.close()
            self.projector = None
        if getattr(self, "ctx", None):
            if self.nextn is not None:
                self.nextn.close()
            if self.head_model is not None:
                L.llama_model_free(self.head_model)
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            self.ctx = None
