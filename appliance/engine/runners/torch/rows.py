"""How many rows a CPU matmul is given, so that a row's result never depends on how many rows
share its call (the runner's exactness property: a one-token step equals the same row of a
k-token verify bit for bit, which probe.check_exact proves at start).

Measured (float32, 2 threads): on an AVX2 host a call of 1-3, 5-7 or 9-11 rows computes each
row unlike a call of a multiple of 4 or of 12 or more rows; on an AVX-512 host calls of 1-3
rows differ from calls of 4 or more. Padded with zero rows to a multiple of ROW_GROUP below
ROWS_FREE, every row is computed alike on both (the padding costs a decode step little: the
weights are read once whatever the row count).
"""
from __future__ import annotations

import torch

ROW_GROUP, ROWS_FREE = 4, 12


def padded_rows(m: int) -> int:
    return m if m >= ROWS_FREE or m % ROW_GROUP == 0 else m + (-m % ROW_GROUP)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, ...] with zero rows appended to padded_rows(M) rows, on a CPU (a GPU: x itself)."""
    m = x.shape[0]
    rows = padded_rows(m) if x.is_cpu else m
    return torch.cat((x, x.new_zeros(rows - m, *x.shape[1:]))) if rows > m else x
