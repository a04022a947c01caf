"""Fixed-shape decode for the llama.cpp runner: every decode-family forward (a one-token step, a
verify of a draft) runs as one batch shape of `decode_rows` rows a stream, so a step and a
verify take the same kernels and the same reduction order (spec/shape.py proves it and weighs
its cost at start; docs/speculation.md has the measurements).

Why a one-row step and a k-row verify differ in llama.cpp's plain mode (its vendored source,
llama-cpp-python 0.3.36): ggml-cpu's llamafile sgemm (tinyBLAS) refuses n < 2 rows, so a step's
matmuls (weights of the types it handles, and attention's K*Q and V*softmax over an f16 cache)
take ggml's vec_dot path and a verify's take tinyBLAS, which sums in another order; flash
attention splits a one-row query's keys over the threads from 512 keys on (`neq1 == 1`); and a
batch that asks for fewer output rows computes its last layer's FFN on those rows only
(`inp_out_ids`). At a fixed shape none of that varies:

- Spare rows: a span of r < K real tokens is padded with K - r copies of its last token at the
  positions after it, in its own sequence, every row's logits asked for (so the last layer runs
  on all K rows), and those cells are removed right after (`llama_memory_seq_rm`). A real row
  never sees them: the causal mask hides every later position from a row, exactly as a verify's
  drafted rows are hidden from its first. They cost compute, never output.
- The KV window: attention runs over n_kv cells, the used cells padded to 256
  (`llama_kv_cache::get_n_kv`), and a fixed-shape forward at position p fills cells up to
  p + K, its spare rows included. So a verify at p has the window of p + K and the step at
  p + j that of p + j + K: they differ where a 256-cell edge lies between. The masked cells
  add exact zeros, and on this CPU tinyBLAS and vec_dot sum each output element over the whole
  key range, so the sums do not change; lavapipe's kernels do change with the window from
  1,024 cells (stop 77 measured a 0.0109 logit difference there). So a draft stops where its
  steps' windows would leave the verify's (`Policy.draft_room`, `kv_window`): every row sees
  the window it sees at a step, and on any backend a row's kernels are the same. The start-up
  probe checks a verify whose last step fills its window to the last cell. The row's index in
  the batch does not matter: each output element is one dot product over the inner dimension.
- Several streams: one llama_decode carries the fixed-shape spans of up to
  min(n_batch, n_ubatch) // K streams, each K rows; with a KV stream per slot llama.cpp's equal
  split keeps them in one micro-batch, and attention is computed per stream at K query rows. The
  window is the widest of the streams in the call, so a stream's rows are those it gets alone
  where the kernels do not depend on the window (this CPU: the identity tests decode two streams
  together); where they do (lavapipe from 1,024 cells) streams decoded together may differ from
  one decoded alone, with speculation or without, as any batching does. Spans cut short at the
  context's end (fewer than K positions left) run in calls of their own, so they never split
  another stream's batch; the speculator drafts only where a verify's rows and every step among
  them get K rows (`Policy.pad`).
- Not here: a KV pool the slots share (--kv-unified): cells there depend on the other slots,
  and the padding would take the pool's cells; the mode is not offered there.
"""
from __future__ import annotations

from typing import Sequence

import llama_cpp as L

from .base import Span

KV_WINDOW = 256   # llama.cpp pads its KV window to this many cells (max(n_pad, 256) in get_n_kv)


class FixedShape:
    """A mixin of LlamaCppRunner: `set_decode_rows(K)` turns the fixed shape on (0: plain)."""

    decode_rows: int = 0
    kv_window: int = KV_WINDOW

    def set_decode_rows(self, rows: int) -> None:
        """Decode-family spans (every row's logits wanted, at most `rows` tokens) run at `rows`
        rows from now on; 0 turns it off. ValueError where the runner cannot hold the shape."""
        if rows:
            if rows < 2 or self.fixed_streams(rows) < 1:
                raise ValueError(f"a fixed decode shape of {rows} rows needs 2 to "
                                 f"{min(self.n_batch, self.llamacpp.n_ubatch)} rows (--n-batch, --n-ubatch)")
            if self.info.kv_unified:
                raise ValueError("a fixed decode shape needs a KV stream per slot (not --kv-unified)")
        self.decode_rows = rows

    def fixed_streams(self, rows: int) -> int:
        """How many streams' spans of `rows` rows one llama_decode holds in one micro-batch."""
        return min(self.n_batch, self.llamacpp.n_ubatch) // rows

    def _fixed_forward(self, spans: Sequence[Span], out: list) -> set[int]:
        """Compute the decode-family spans at the fixed shape into `out`; their indices."""
        rows = self.decode_rows
        if not rows:
            return set()
        n_seq = L.llama_n_ctx_seq(self.ctx)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(spans):
            if s.n_logits == len(s.tokens) <= rows and min(s.tokens) >= 0:
                groups.setdefault(max(len(s.tokens), min(rows, n_seq - s.start_pos)), []).append(i)
        per_call = self.fixed_streams(rows)
        for width, picked in sorted(groups.items()):
            for c in range(0, len(picked), per_call):
                part = picked[c:c + per_call]
                padded = [self._padded(spans[i], width) for i in part]
                got: list = [None] * len(part)
                self._decode(padded, [got, list(range(len(part)))])
                for j, i in enumerate(part):
                    s = spans[i]
                    out[i] = got[j][:len(s.tokens)]
                    L.llama_memory_seq_rm(self.mem, s.slot, s.start_pos + len(s.tokens), -1)
        return {i for picked in groups.values() for i in picked}

    @staticmethod
    def _padded(s: Span, width: int) -> Span:
        tokens = s.tokens + (s.tokens[-1],) * (width - len(s.tokens))
        return Span(s.slot, tokens, s.start_pos, width, s.lora)
