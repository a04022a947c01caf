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
from types import SimpleNamespace
from typing import Any, Sequence

from ..compute_settings import LlamaCppSettings, thread_env
from ..engine.grid import Grid
from ..rope import RopeScaling
from .client import BenchError
from .raw_run import speculative_run, timed_run


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
    kv_unified: bool = False        # the engine's slots share one pool of n_ctx positions

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
                   kv_type=str(s.get("kv_type") or "f16"), kv_unified=bool(s.get("kv_unified", False)))


@dataclass(frozen=True)
class RawResult:
    ttft_ms: list[float]            # per sequence: its prefill and first sample, alone
    decode_tps: float               # per stream, over the steps where all decode together
    aggregate_tps: float            # all streams together
    tokens: list[list[int]]         # per sequence, the n_gen greedy tokens
    speculation: dict | None = None # with speculate=True: raw_run.speculative_run's account


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
        seqs, n_gen, speculate = msg
        try:
            conn.send(("ok", speculative_run(llama, seqs, n_gen) if speculate else llama.run(seqs, n_gen)))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", str(e)))


_QUIET: Any = None


def quiet_llama_log() -> None:
    """Silence llama.cpp's log in this process, with one callback kept for the process's life
    (llama.cpp calls the last one set, even from a later model's free: one held by an object
    that was collected crashed it)."""
    global _QUIET
    import llama_cpp as L

    if _QUIET is None:
        _QUIET = L.llama_log_callback(lambda *a: None)
    L.llama_log_set(_QUIET, ctypes.c_void_p(0))


class _Llama:  # pragma: no cover - runs in the child
    """The model and its context in the worker, through llama.cpp's low-level API."""

    def __init__(self, model_path: str, st: RawSettings) -> None:
        import llama_cpp as L
        import numpy as np

        self.L, self.np, self.st = L, np, st
        quiet_llama_log()
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
        self.info, self.spec_policy = SimpleNamespace(n_ctx=st.n_ctx), None   # for speculative_run

    def _context_params(self) -> Any:
        L, st, ls = self.L, self.st, self.st.llamacpp
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = st.n_ctx * (1 if st.kv_unified else st.n_slots), st.n_slots, st.kv_unified
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

    # what speculative_run and the start-up probes ask of a runner (engine/runners/base.py's shapes)
    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.L.llama_token * (len(data) + 16))()
        n = self.L.llama_tokenize(self.L.llama_model_get_vocab(self.model), data, len(data), buf, len(buf), False, False)
        return list(buf[:n])

    def forward(self, spans: Sequence[Any]) -> list[Any]:
        """Each span's last n_logits rows of logits: one span of any length (in n_batch pieces),
        or several that fit one batch, decoded together."""
        if len(spans) == 1 and len(spans[0].tokens) > self.st.llamacpp.n_batch:
            sp = spans[0]
            for start in range(0, len(sp.tokens) - self.st.llamacpp.n_batch, self.st.llamacpp.n_batch):
                self.decode([(t, sp.start_pos + start + j, sp.slot, False)
                             for j, t in enumerate(sp.tokens[start:start + self.st.llamacpp.n_batch])])
            cut = len(sp.tokens) - (len(sp.tokens) - 1) % self.st.llamacpp.n_batch - 1
            spans = [type(sp)(sp.slot, sp.tokens[cut:], sp.start_pos + cut, sp.n_logits)]
        entries, rows = [], []
        for sp in spans:
            n = len(sp.tokens)
            rows.append(range(len(entries) + n - sp.n_logits, len(entries) + n))
            entries += [(t, sp.start_pos + j, sp.slot, j >= n - sp.n_logits) for j, t in enumerate(sp.tokens)]
        self.decode(entries)
        return [self.np.stack([self.logits(i) for i in r]) for r in rows]

    def logits(self, row: int) -> Any:
        return self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,)).copy()

    def truncate(self, seq: int, pos: int) -> None:
        self.L.llama_memory_seq_rm(self.mem, seq, pos, -1)


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

    def run(self, seqs: Sequence[Sequence[int]], n_gen: int, speculate: bool = False) -> RawResult:
        """Prefill each sequence alone, then decode them together greedily; with `speculate`, with
        the speculation the server would run on this runner (raw_run.speculative_run)."""
        if len(seqs) > self.settings.n_slots:
            raise ValueError(f"{len(seqs)} sequences for {self.settings.n_slots} slots")
        self._conn.send(([list(s) for s in seqs], n_gen, speculate))
        ttft, rate, aggregate, tokens, *spec = self._recv()
        return RawResult(ttft_ms=ttft, decode_tps=rate, aggregate_tps=aggregate, tokens=tokens,
                         speculation=spec[0] if spec else None)

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
