"""GGUF weights for the torch runner, read through the `gguf` package.

The file is memory-mapped (`GGUFReader`), and tensors are dequantized one at a time into the
compute dtype, so loading never holds two copies of the model: the peak is the converted
model plus one tensor in float32. The quantized blocks stay reachable through the map
(`blocks`) for kernels that compute on them directly.

Shapes: GGUF lists dimensions innermost first; `gguf` gives the data row-major, so a matrix
of ggml shape [in, out] arrives as [out, in], which is PyTorch's `nn.Linear` layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

import gguf

from ....errors import ModelLoadError

_MISSING = object()


@dataclass(frozen=True)
class QuantBlocks:
    """A tensor as stored: the raw rows (a view into the memory map), its type, its shape."""

    data: np.ndarray            # [..., rows, bytes per row] for quantized types
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # logical, PyTorch order
    scale: float | None = None  # a tensor scale the blocks' values are multiplied by (ModelOpt NVFP4)


class GGUFWeights:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
            raise ModelLoadError(f"{self.path}: not a readable GGUF file "
                                 f"({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (a scalar, a string, or a list); `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def blocks(self, name: str) -> QuantBlocks:
        t = self._tensor(name)
        return QuantBlocks(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))

    def load(self, name: str, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor dequantized to `dtype` on `device`, checked against the expected shape."""
        t = self._tensor(name)
        got = tuple(int(d) for d in reversed(t.shape))
        if got != tuple(shape):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {list(got)}, "
                                 f"expected {list(shape)}")
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, "
                                 "which this runner cannot dequantize") from None
        values = np.asarray(values, dtype=np.float32).reshape(got)
        if not values.flags.writeable:  # an F32 tensor arrives as a view of the read-only map
            values = values.copy()
        out = torch.from_numpy(values).to(device=device, dtype=dtype)
        del values
        return out

    def _tensor(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        return t
