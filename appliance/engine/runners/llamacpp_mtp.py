"""llama.cpp's multi-token-prediction (next-n) head, driven through its own MTP context.

A GGUF whose architecture has next-n blocks (`{arch}.nextn_predict_layers` > 0; the ones the
vendored llama.cpp can run are MTP_ARCHS) carries, after its trunk, a block that predicts the
token after next: given token x_p and the trunk's last hidden state at p - 1, h_{p-1}, it
returns logits for x_{p+1} and its own hidden state, which feeds the next draft step.
llama.cpp runs that block in a second context of the same model (`ctx_type =
LLAMA_CONTEXT_TYPE_MTP`: the weights are shared, the context has a KV cache for the next-n
block alone) and hands the trunk's hidden rows over when the target context is told to keep
them (`llama_set_embeddings_nextn`, unmasked: a row for every token of a batch, in batch
order). This file is that plumbing and nothing more: `NextnHead.forward` runs tokens paired
with hidden rows in the MTP context; what to feed it, and when, is `spec/mtp.py`'s.

Three of the calls are C++ in llama-cpp-python 0.3.36's libllama (`src/llama-ext.h`, a
"staging API" without `extern "C"`), so they are looked up by their Itanium-mangled names;
`available()` says whether this build has them. The batch that carries a hidden row with each
token is `llama_batch_ext` (`llama_batch_ext_set_embd_token`; `..._set_embd_state` is a stub
in this version), run with `llama_process`, as llama.cpp's common/speculative.cpp does.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

import llama_cpp as L
from llama_cpp import llama_cpp as _bindings

from ...errors import EngineFailure, ModelLoadError

# Architectures whose model file in the vendored llama.cpp builds an LLM_GRAPH_TYPE_DECODER_MTP
# graph (src/models/*.cpp). Others may carry next-n tensors (glm4, exaone4, exaone-moe keep
# them "preserved but unused"); llama.cpp cannot draft with those.
MTP_ARCHS = frozenset({"glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32", "deepseek4",
                       "qwen35", "qwen35moe", "qwen3next", "mimo2", "step35", "bailingmoe3",
                       "cohere2moe", "hy_v3", "nemotron_h_moe"})

_MANGLED = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context",
                             [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
}


def _ext(name: str):
    symbol, args, res = _MANGLED[name]
    fn = getattr(_bindings._lib, symbol)
    fn.argtypes, fn.restype = args, res
    return fn


def available() -> bool:
    """Whether this libllama exports the MTP calls (llama-cpp-python 0.3.36's does)."""
    try:
        for name in _MANGLED:
            _ext(name)
        return hasattr(L, "llama_batch_ext_init") and hasattr(L, "LLAMA_CONTEXT_TYPE_MTP")
    except AttributeError:
        return False


def why_not(arch: str, n_nextn: int) -> str | None:
    """Why this model cannot draft with its own MTP head (None: it can)."""
    if n_nextn <= 0:
        return (f"the model ({arch}) has no next-n (MTP) layers; MTP drafting needs a GGUF that "
                f"keeps them (llama.cpp runs them for {', '.join(sorted(MTP_ARCHS))})")
    if arch not in MTP_ARCHS:
        return (f"the model ({arch}) carries {n_nextn} next-n layer(s) but this llama.cpp has no MTP "
                f"graph for {arch} (it has one for {', '.join(sorted(MTP_ARCHS))})")
    if not available():
        return "this llama-cpp-python build does not export llama.cpp's MTP calls"
    return None


def keep_target_rows(target_ctx: L.llama_context_p) -> None:
    """Make the target context keep the trunk's hidden row of every token of each batch."""
    _ext("set_embeddings_nextn")(target_ctx, True, False)


def target_rows(target_ctx: L.llama_context_p, n: int, n_embd: int) -> np.ndarray:
    """The trunk's hidden rows of the last batch: [n, n_embd], in batch order (a copy)."""
    ptr = _ext("get_embeddings_nextn")(target_ctx)
    if not ptr:
        raise EngineFailure("llama.cpp kept no next-n rows for the last batch")
    return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()


class NextnHead:
    """The MTP context of a loaded model, the served one or its head's sidecar: one KV stream per
    slot, the target's settings."""

    def __init__(self, model: L.llama_model_p, cp: L.llama_context_params, n_batch: int,
                 target_ctx: L.llama_context_p) -> None:
        self.n_embd = L.llama_model_n_embd(model)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.n_batch = n_batch
        cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        cp.embeddings = False
        # as llama.cpp's common_speculative_init_result makes every MTP draft context: no
        # recurrent snapshots, and the target's context beside it (the architectures whose head
        # shares the target's KV read it there; the others ignore it)
        cp.n_rs_seq = 0
        cp.ctx_other = target_ctx
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise ModelLoadError("llama.cpp could not create the MTP context for this model")
        _ext("set_embeddings_nextn")(self.ctx, True, True)   # the head's own rows, for output rows
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_ext_init(self.ctx)
        self._pos = (L.llama_pos * 1)()

    def forward(self, items: Sequence[tuple[int, Sequence[int], int, np.ndarray, int]]
                ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Run each (slot, tokens, start_pos, h [len(tokens), n_embd], n_out): token j at
        start_pos + j paired with hidden row h[j]. For each item, the logits of its last n_out
        tokens [n_out, n_vocab] and the head's hidden rows there [n_out, n_embd] (copies)."""
        out: list[tuple[list, list]] = [([], []) for _ in items]
        piece: list[tuple[int, int]] = []    # (item, batch index) of the rows to read back
        n = 0
        L.llama_batch_ext_clear(self.batch)
        for i, (slot, toks, start, h, n_out) in enumerate(items):
            h = np.ascontiguousarray(h, dtype=np.float32)
            for j, tok in enumerate(toks):
                if n == self.n_batch:
                    self._run(piece, out)
                    piece, n = [], 0
                idx = L.llama_batch_ext_add_token(self.batch, slot, int(tok))
                if idx < 0:
                    raise EngineFailure(f"the MTP batch refused token {tok} of slot {slot} (code {idx})")
                self._pos[0] = start + j
                L.llama_batch_ext_set_pos(self.batch, idx, self._pos)
                row = h[j]
                embd = L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
                if not L.llama_batch_ext_set_embd_token(self.batch, idx, embd):
                    raise EngineFailure("the MTP batch refused a hidden row")
                wanted = j >= len(toks) - n_out
                L.llama_batch_ext_set_output_logits(self.batch, idx, wanted)
                if wanted:
                    piece.append((i, idx))
                n += 1
        if n:
            self._run(piece, out)
        return [(np.stack(lg) if lg else np.empty((0, self.n_vocab), np.float32),
                 np.stack(h) if h else np.empty((0, self.n_embd), np.float32)) for lg, h in out]

    def _run(self, piece: list[tuple[int, int]], out: list) -> None:
        rc = L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise EngineFailure(f"llama_process failed with code {rc} in the MTP context")
        get_h = _ext("get_embeddings_nextn_ith")
        for i, idx in piece:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,)).copy()
            h = np.ctypeslib.as_array(get_h(self.ctx, idx), shape=(self.n_embd,)).copy()
            out[i][0].append(logits)
            out[i][1].append(h)
        L.llama_batch_ext_clear(self.batch)

    def truncate(self, slot: int, n_keep: int) -> None:
        L.llama_memory_seq_rm(self.mem, slot, n_keep, -1)

    def close(self) -> None:
        if self.ctx:
            L.llama_batch_ext_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None
