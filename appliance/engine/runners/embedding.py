"""Embeddings through llama.cpp: a context made for them over a loaded model.

llama.cpp pools each sequence's last hidden states (after the output norm) itself when the
context's pooling type is mean, cls or last (`llama_get_embeddings_seq`). A model that pools
none (its GGUF says so, or --pooling none) answers a vector per token where the API can say it
(llama-server's /embeddings, `embed_tokens`), and the mean of them where one vector per input is
asked (`embed`: OpenAI's, Ollama's); rank pooling (a reranker's score) is refused.

The context's shape, and why:
- embeddings on: every token of a batch is an output, and each sequence gets its vector.
- one KV buffer for all sequences (`kv_unified`), cleared before every batch: with a stream
  per sequence llama.cpp cuts a batch into equal per-sequence micro-batches, and it pools per
  micro-batch, so a sequence cut in two would get the mean of its last piece only.
- n_ubatch = n_batch = n_ctx, so a batch is one micro-batch. Hence the longest input is
  n_batch tokens (at most the trained context), as llama-server's physical batch bounds its.

`LlamaEmbeddings` is that context; `EmbeddingRunner` is an embedding model's whole runner (its
vocabulary and that context, nothing that generates); `for_chat_model` puts the context on a
chat model's loaded weights (mean pooling), beside the context that generates.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import llama_cpp as L

from ...compute_settings import LlamaCppSettings
from ...config import EngineConfig
from ...errors import EngineFailure, ModelLoadError
from ...models import file_fingerprint
from .base import RunnerInfo
from .llamacpp import LlamaCppRunner, kv_bytes
from .placement import place_model
from .vocab import TextMethods, Vocab, init_backend, load_model, meta

log = logging.getLogger("appliance.llamacpp")

POOLING = {L.LLAMA_POOLING_TYPE_NONE: "none", L.LLAMA_POOLING_TYPE_MEAN: "mean", L.LLAMA_POOLING_TYPE_CLS: "cls",
           L.LLAMA_POOLING_TYPE_LAST: "last", L.LLAMA_POOLING_TYPE_RANK: "rank"}
POOLING_OF = {None: L.LLAMA_POOLING_TYPE_UNSPECIFIED, **{name: kind for kind, name in POOLING.items()}}  # --pooling


class LlamaEmbeddings:
    """An embeddings context on a loaded model (which the caller owns and frees after this)."""

    def __init__(self, model: L.llama_model_p, s: LlamaCppSettings, pooling: int, what: str) -> None:
        n_ctx_train = L.llama_model_n_ctx_train(model)
        self.max_tokens = min(s.n_batch, n_ctx_train) if n_ctx_train > 0 else s.n_batch
        self.n_seq_max = min(self.max_tokens, L.llama_max_parallel_sequences())
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.max_tokens
        cp.n_seq_max = self.n_seq_max
        cp.kv_unified = True
        cp.embeddings = True
        cp.pooling_type = pooling
        cp.n_threads = cp.n_threads_batch = s.n_threads_batch   # every forward is prefill-shaped
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if s.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise ModelLoadError(f"{what}: llama.cpp could not create an embeddings context of "
                                 f"{self.max_tokens} tokens")
        self.pooling = L.llama_pooling_type(self.ctx)
        if self.pooling == L.LLAMA_POOLING_TYPE_RANK:
            L.llama_free(self.ctx)
            raise ModelLoadError(f"{what}: a reranker (its pooling is rank: a score, not an embedding)")
        self.per_token = self.pooling == L.LLAMA_POOLING_TYPE_NONE
        self.n_embd = L.llama_model_n_embd_out(model)
        self.mem = L.llama_get_memory(self.ctx)      # none for encoders without a KV cache (BERT)
        self.batch = L.llama_batch_init(self.max_tokens, 0, 1)

    def report(self) -> dict[str, Any]:
        """/health's settings.embeddings."""
        return {"pooling": POOLING[self.pooling], "n_embd": self.n_embd, "max_tokens": self.max_tokens,
                "n_seq_max": self.n_seq_max}

    def embed(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(seqs), n_embd] float32: each sequence's pooled state, all in one llama_decode (the
        caller keeps to max_tokens tokens in all and n_seq_max sequences)."""
        self._decode(seqs)
        if self.pooling != L.LLAMA_POOLING_TYPE_NONE:
            return np.stack([self._row(L.llama_get_embeddings_seq(self.ctx, seq)) for seq in range(len(seqs))])
        return np.stack([rows.mean(axis=0) for rows in self._token_rows(seqs)])

    def embed_tokens(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each sequence's [len(seq), n_embd] token states (a context that pools none), one decode."""
        assert self.per_token, "a pooling context has no per-token states"
        self._decode(seqs)
        return [rows.copy() for rows in self._token_rows(seqs)]

    def _token_rows(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        n = sum(len(t) for t in seqs)
        rows = np.ctypeslib.as_array(L.llama_get_embeddings(self.ctx), shape=(n, self.n_embd))
        ends = np.cumsum([len(t) for t in seqs])
        return [rows[end - len(t):end] for t, end in zip(seqs, ends)]

    def _decode(self, seqs: Sequence[Sequence[int]]) -> None:
        b, n = self.batch, 0
        for seq, toks in enumerate(seqs):
            for pos, tok in enumerate(toks):
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, pos, 1
                b.seq_id[n][0], b.logits[n] = seq, True
                n += 1
        b.n_tokens = n
        if self.mem:
            L.llama_memory_clear(self.mem, True)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc} on an embeddings batch of {n} tokens")

    def _row(self, ptr) -> np.ndarray:
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def close(self) -> None:
        if self.ctx:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None


def for_chat_model(runner: Any) -> LlamaEmbeddings:
    """--embedding-model chat: an embeddings context on the chat runner's weights, mean pooling
    (the mean of the last hidden states), beside the context that generates."""
    if not isinstance(runner, LlamaCppRunner):
        raise ModelLoadError("--embedding-model chat needs the llama.cpp runner (--engine llamacpp)")
    return LlamaEmbeddings(runner.model, runner.llamacpp, L.LLAMA_POOLING_TYPE_MEAN, runner.info.model_path)


class EmbeddingRunner(TextMethods):
    """An embedding model (--embedding-model PATH): its vocabulary and an embeddings context with
    the pooling its GGUF names, nothing that generates."""

    def __init__(self, cfg: EngineConfig, model_path: Path, model_name: str) -> None:
        init_backend()
        s = cfg.llamacpp()
        placed = place_model(cfg, model_path, s.flash_attn)
        self.model = load_model(model_path, params=placed.model_params(cfg.main_gpu))
        self.text = Vocab(self.model)
        try:
            self.embeddings = LlamaEmbeddings(self.model, s, POOLING_OF[cfg.pooling], str(model_path))
        except ModelLoadError:
            L.llama_model_free(self.model)
            raise
        e = self.embeddings
        self.info = RunnerInfo(
            backend="llama.cpp", model_path=str(model_path), model_name=model_name,
            arch=meta(self.model, "general.architecture") or "unknown", n_ctx=e.max_tokens,
            n_ctx_train=L.llama_model_n_ctx_train(self.model), n_slots=1, **self.text.facts(),
            kv_bytes=kv_bytes(self.model, "f16", e.max_tokens) if e.mem else 0,
            settings={**s.as_dict(), "embeddings": e.report(), "llama_cpp_python": L.__version__},
            fingerprint=file_fingerprint(model_path), placement=placed.summary())

    def close(self) -> None:
        if getattr(self, "model", None):
            self.embeddings.close()
            L.llama_model_free(self.model)
            self.model = None
