"""A fake ModelRunner for scheduler tests: deterministic logits, KV tracked as token lists.

Its "model" predicts (last token + 1) mod n_vocab, so an output is easy to predict; every
`forward` is recorded, and the KV invariant (spans continue exactly where the slot's KV ends)
is asserted on every call. With `unified`, the slots share one pool of n_ctx cells (as
llama.cpp's kv_unified) and a forward or restore past it fails as llama_decode would.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from appliance.engine.runners.base import RunnerInfo, Span

N_VOCAB = 64
EOG = 63


class FakeRunner:
    def __init__(self, n_slots: int = 2, n_ctx: int = 4096, unified: bool = False) -> None:
        self.info = RunnerInfo(
            backend="fake", model_path="/dev/null", model_name="fake", arch="fake", n_vocab=N_VOCAB,
            n_ctx=n_ctx, n_ctx_train=n_ctx, n_slots=n_slots, eog_ids=frozenset({EOG}), bos_id=None,
            add_bos=False, chat_template=None, bos_text="", eos_text="", kv_bytes=0, kv_unified=unified)
        self.kv: list[list[int]] = [[] for _ in range(n_slots)]
        self.calls: list[list[Span]] = []

    def kv_fingerprint(self) -> str:
        return f"fake|n_ctx={self.info.n_ctx}"

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return [ord(c) % 26 for c in text]

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return bytes(ord("a") + t % 26 for t in ids if t != EOG)

    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        self.calls.append(list(spans))
        out = []
        for s in spans:
            assert s.start_pos == len(self.kv[s.slot]), "span must continue the slot's KV"
            self.kv[s.slot].extend(s.tokens)
            self._check_pool()
            rows = np.full((s.n_logits, N_VOCAB), -1.0, np.float32)
            for r in range(s.n_logits):
                last = s.tokens[len(s.tokens) - s.n_logits + r]
                rows[r, (last + 1) % N_VOCAB] = 1.0
            out.append(rows)
        return out

    def truncate(self, slot: int, n_keep: int) -> None:
        del self.kv[slot][n_keep:]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.kv[dst] = list(self.kv[src][:n])

    def save(self, slot: int) -> bytes:
        return bytes(self.kv[slot])

    def restore(self, slot: int, blob: bytes) -> None:
        self.kv[slot] = list(blob)
        self._check_pool()

    def kv_used(self, slot: int) -> int:
        return len(self.kv[slot])

    def _check_pool(self) -> None:
        used = sum(map(len, self.kv))
        assert not self.info.kv_unified or used <= self.info.n_ctx, f"the shared pool overflowed: {used} cells"

    def close(self) -> None:
        pass
