"""The raw reference row: the same model and settings driven through llama.cpp's low-level API
directly, in a process of its own, with nothing of the appliance in the path. The served rows
divided by these show what serving costs (shared/BENCHMARKING.md; issue #5).

The worker mirrors the engine's llama.cpp context: n_slots sequences of n_ctx positions each
(not unified), the same threads, batch sizes, flash-attention setting and KV type, and prompts
prefilled in chunks on the same fixed grid of absolute positions, each chunk its own
llama_decode. It decodes greedily (lowest id on ties, as numpy's argmax) and ignores
end-of-generation tokens, as the served rate rows ask with `ignore_eos`.

    with RawReference(model_path, settings) as raw:
        raw.run([ids], n_gen)          # one stream: ttft_ms, decode_tps, tokens
        raw.run([ids] * 4, n_gen)      # four streams decoded together: per stream and aggregate
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any, Sequence

from ..compute_settings import LlamaCppSettings, thread_env
from ..engine.grid import Grid
from ..rope import RopeScaling
from .client import BenchError
from .raw_run import timed_run


@dataclass(frozen=True)
class RawSettings:
    n_ctx: int                      # positions per sequence
    n_slots: int                    # sequences, one KV stream each
    llamacpp: LlamaCppSettings
    grid: Grid                      # where prompts are cut into llama_decode calls
    thread_wait: str = "spin"       # how its threads wait (compute_settings.thread_env), as the engine's
    rope: RopeScaling | None = None # the engine's RoPE scaling (None: the model's, from a server before it)
    kv_type: str = "f16"            # the engine's KV cache type (f16, q8_0, q4_0: flash attention is on with it)
    engine: str = "llamacpp"        # or "torch": the torch runner in the worker (raw_torch.py), for tune --engines
    engine_flags: tuple[tuple[str, Any], ...] = ()   # more EngineConfig fields for the torch runner (its RoPE)

    @classmethod
    def from_health(cls, health: dict[str, Any], prefill_chunk: int) -> RawSettings:
        """The server's settings as its /health reports them (prefill_chunk: when it does not)."""
        s = health["settings"]
        reuse = s.get("prompt_cache_reuse") or {}  # where the server cuts a prompt's last chunk
        return cls(n_ctx=int(health["n_ctx"]), n_slots=int(health["n_slots"]),
                   llamacpp=LlamaCppSettings.from_mapping(s),
                   grid=Grid(int(s.get("prefill_chunk") or prefill_chunk), int(reuse.get("min_chunk") or 0)),
                   # a server from before the setting spun, as libgomp does by default
                   thread_wait=str(s.get("thread_wait", "spin")),
                   rope=RopeScaling.from_dict(s["rope"]) if isinstance(s.get("rope"), dict) else None,
                   kv_type=str(s.get("kv_type") or "f16"))


@dataclass(frozen=True)
class RawResult:
    ttft_ms: list[float]            # per sequence: its prefill and first sample, alone
    decode_tps: float               # per stream, over the steps where all decode together
    aggregate_tps: float            # all streams together
    tokens: list[list[int]]         # per sequence, the n_gen greedy tokens


class RawError(BenchError):
    """The raw worker could not load, answer or compute."""


def _worker(conn, model_path: str, st: RawSettings) -> None:  # pragma: no cover - runs in the child
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle; it closes us
    os.environ.update(thread_env(st.thread_wait))   # as the engine waits, before llama.cpp loads
    try:
        if st.engine == "torch":
            from .raw_torch import TorchWorker

            llama: Any = TorchWorker(model_path, st)
        else:
            llama = _Llama(model_path, st)
    except BenchError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        seqs, n_gen = msg
        try:
            conn.send(("ok", llama.run(seqs, n_gen)))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", str(e)))


class _Llama:  # pragma: no cover - runs in the child
    """The model and its context in the worker, through llama.cpp's low-level API."""

    def __init__(self, model_path: str, st: RawSettings) -> None:
        import llama_cpp as L
        import numpy as np

        self.L, self.np, self.st = L, np, st
        self._quiet = L.llama_log_callback(lambda *a: None)  # keep a reference: llama.cpp calls it later
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RawError(f"llama.cpp could not load {model_path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = L.llama_init_from_model(self.model, self._context_params())
        if not self.ctx:
            raise RawError(f"llama.cpp could not create a context of {st.n_slots} x {st.n_ctx}")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(max(st.llamacpp.n_batch, st.n_slots), 0, st.n_slots)

    def _context_params(self) -> Any:
        L, st, ls = self.L, self.st, self.st.llamacpp
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = st.n_ctx * st.n_slots, st.n_slots, False
        cp.n_batch, cp.n_ubatch = ls.n_batch, min(ls.n_ubatch, ls.n_batch)
        cp.n_threads, cp.n_threads_batch = ls.n_threads, ls.n_threads_batch
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if ls.flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.no_perf = True
        from ..engine.runners.placement import GGML_KV_TYPES

        cp.type_k = cp.type_v = GGML_KV_TYPES[st.kv_type]   # the server's /health says its flash attention
        if st.rope is not None:   # a context past the trained one computes as the engine's
            from ..engine.runners.llamacpp import set_rope

            set_rope(cp, st.rope)
        return cp

    def decode(self, entries) -> None:
        batch = self.batch
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, row: int) -> int:
        logits = self.L.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def prefill(self, seq: int, toks: list[int]) -> int:
        self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        start = 0
        for start, end in self.st.grid.chunks(0, len(toks)):
            self.decode([(toks[p], p, seq, p == len(toks) - 1) for p in range(start, end)])
        return self.argmax(len(toks) - 1 - start)  # the last token's row in the last chunk

    def step(self, entries: list[tuple[int, int, int]]) -> list[int]:
        """One decode step of (token, position, sequence) for each: each one's next token."""
        self.decode([(tok, pos, seq, True) for tok, pos, seq in entries])
        return [self.argmax(i) for i in range(len(entries))]

    def run(self, seqs: list[list[int]], n_gen: int) -> tuple[list[float], float, float, list[list[int]]]:
        return timed_run(self, seqs, n_gen)


class RawReference:
    """The raw worker process; `run` blocks until it answers."""

    def __init__(self, model_path: str, settings: RawSettings, timeout: float = 600.0) -> None:
        self.settings = settings
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, model_path, settings), daemon=True,
                                 name="appliance-bench-raw")
        self._proc.start()
        child.close()
        self._timeout = timeout
        self._recv()  # ready, or the load error

    def _recv(self) -> Any:
        if not self._conn.poll(self._timeout):
            self.close()
            raise RawError(f"the raw llama.cpp worker did not answer within {self._timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RawError(f"the raw llama.cpp worker died (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise RawError(value)
        return value

    def run(self, seqs: Sequence[Sequence[int]], n_gen: int) -> RawResult:
        if len(seqs) > self.settings.n_slots:
            raise ValueError(f"{len(seqs)} sequences for {self.settings.n_slots} slots")
        self._conn.send(([list(s) for s in seqs], n_gen))
        ttft, rate, aggregate, tokens = self._recv()
        return RawResult(ttft_ms=ttft, decode_tps=rate, aggregate_tps=aggregate, tokens=tokens)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> RawReference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
