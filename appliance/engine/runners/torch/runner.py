"""The torch runner: the ModelRunner protocol over `model.py`, for `appliance serve --engine torch`.

Weights come from the GGUF through `weights.py`; text goes through llama.cpp's tokenizer on a
vocab-only load of the same file, so both runners turn the same text into the same ids.

Shapes: spans of up to DECODE_ROWS tokens (decode steps, speculative verifies) run together
in one forward, and every longer span (a prompt chunk) in a forward of its own, cut at
n_batch. The matmul kernels used compute each row independently of the others, and a short
span's attention is padded per row (model.Attention._attend_rows), so a row's logits are the
same whatever else runs and however many rows its span has (probe.check_exact proves it
on the loaded model at start-up).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ....config import EngineConfig
from ....errors import ModelLoadError
from ....models import file_fingerprint
from ..base import RunnerInfo, Span
from ..vocab import TextMethods, Vocab, load_model
from . import model as model_mod, qlinear
from .kv import KVPool
from .weights import GGUFWeights

log = logging.getLogger("appliance.torch")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--torch-device {name}: this torch build sees no CUDA device")
    return dev


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN's bf16 matmul is then fast; without them it is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TorchRunner(TextMethods):
    def __init__(self, cfg: EngineConfig, model_path: Path, model_name: str) -> None:
        self.device = resolve_device(cfg.torch_device)
        self.dtype = resolve_dtype(cfg.torch_dtype, self.device)
        threads, _ = cfg.resolved_threads()
        torch.set_num_threads(threads)
        weights = GGUFWeights(model_path)
        args = model_mod.ModelArgs.from_gguf(weights)
        self._llama = load_model(model_path, vocab_only=True)
        self.text = Vocab(self._llama)
        if self.text.n_vocab != args.n_vocab:
            raise ModelLoadError(f"{model_path}: the tokenizer has {self.text.n_vocab} tokens and "
                                 f"token_embd {args.n_vocab} rows")
        self.int4 = (cfg.torch_int4 and self.device.type == "cpu" and self.dtype == torch.bfloat16
                     and qlinear.available())
        self.model = model_mod.load(weights, args, self.dtype, self.device, int4=self.int4)
        self.weights, self.args, self.n_batch = weights, args, cfg.n_batch
        n_ctx = cfg.n_ctx or args.n_ctx_train
        self.kv_dtype = self.dtype
        self.kv = KVPool(args.n_layer, cfg.n_slots, n_ctx, args.n_head_kv, args.head_dim,
                         self.kv_dtype, self.device)
        self.info = RunnerInfo(
            backend="torch", model_path=str(model_path), model_name=model_name, arch=args.arch,
            n_ctx=n_ctx, n_ctx_train=args.n_ctx_train, n_slots=cfg.n_slots, **self.text.facts(),
            kv_bytes=self.kv.nbytes,
            settings={"n_threads": threads, "n_batch": cfg.n_batch, "dtype": _name(self.dtype),
                      "device": str(self.device), "int4": self.int4, "kv_type": _name(self.kv_dtype),
                      # a str, not torch's TorchVersion: that would import torch where unpickled
                      "torch": str(torch.__version__)},
            fingerprint=file_fingerprint(model_path))

    def kv_fingerprint(self) -> str:
        """What a saved state's validity depends on: the model file, the context, the KV dtype,
        torch's version, and the dtype, device, kernels, batch cut and threads that change the
        computed KV (torch's CPU matmuls may split their sums by thread)."""
        s = self.info.settings
        return "|".join([self.info.fingerprint, f"n_ctx={self.info.n_ctx}", f"kv={s['kv_type']}",
                         *(f"{k}={s[k]}" for k in ("torch", "dtype", "device", "int4", "n_batch", "n_threads"))])

    # -- compute -------------------------------------------------------------------------
    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(spans)
        # decode steps and verify spans together (each row is computed as it would be alone),
        # every longer span (a prompt chunk) in its own forward
        short = [i for i, s in enumerate(spans) if len(s.tokens) <= model_mod.DECODE_ROWS]
        if short:
            self._run([spans[i] for i in short], short, out)
        for i, s in enumerate(spans):
            if len(s.tokens) > model_mod.DECODE_ROWS:
                self._run_long(s, i, out)
        return out  # type: ignore[return-value]

    def _run_long(self, s: Span, i: int, out: list) -> None:
        """A prompt span in pieces of at most n_batch tokens, as the llama.cpp runner cuts it, so
        a whole prompt and the same prompt in grid chunks are computed in the same shapes."""
        rows = []
        for at in range(0, len(s.tokens), self.n_batch):
            piece = s.tokens[at:at + self.n_batch]
            left = len(s.tokens) - at - len(piece)               # tokens after this piece
            want = max(0, min(len(piece), s.n_logits - left))
            got: list = [None]
            self._run([Span(s.slot, piece, s.start_pos + at, want)], [0], got)
            rows.append(got[0])
        out[i] = rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _run(self, spans: Sequence[Span], where: Sequence[int], out: list) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        segs, rows = [], []
        for s in spans:
            segs.append(model_mod.Segment(s.slot, len(tokens), len(s.tokens), s.start_pos))
            rows.extend(range(len(tokens) + len(s.tokens) - s.n_logits, len(tokens) + len(s.tokens)))
            tokens.extend(s.tokens)
            positions.extend(range(s.start_pos, s.start_pos + len(s.tokens)))
        # denormal float32 arithmetic on x86 is ~20x slower: flush them while the model runs, and
        # only then (the flag is process state that other code, hypothesis for one, refuses)
        dev = self.device
        torch.set_flush_denormal(True)
        try:
            logits = self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                        segs, torch.tensor(rows, dtype=torch.long, device=dev), self.kv)
        finally:
            torch.set_flush_denormal(False)
        logits = logits.cpu().numpy()
        at = 0
        for s, i in zip(spans, where):
            out[i] = logits[at:at + s.n_logits]
            at += s.n_logits

    # -- KV ------------------------------------------------------------------------------
    def truncate(self, slot: int, n_keep: int) -> None:
        self.kv.truncate(slot, n_keep)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.kv.copy_prefix(src, dst, n)

    def save(self, slot: int) -> bytes:
        return self.kv.save(slot)

    def restore(self, slot: int, blob: bytes) -> None:
        self.kv.restore(slot, blob)

    def close(self) -> None:
        if getattr(self, "_llama", None):
            import llama_cpp as L

            L.llama_model_free(self._llama)
            self._llama = None
