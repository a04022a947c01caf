"""GGUF weights for the torch runner, read through the project's header reader and `gguf`.

The file is memory-mapped, its header read by `fit.gguf_header` (gguf's own `GGUFReader` builds
a numpy view per tokenizer string: ~2 s for SmolLM2's 49,000 before a tensor is touched), and
each tensor is a numpy view into the map laid out as `GGUFReader` gives it. Tensors are
dequantized one at a time into the compute dtype, so loading never holds two copies of the
model: the peak is the converted model plus one tensor in float32. The quantized blocks stay
reachable through the map (`blocks`) for kernels that compute on them directly.

Shapes: GGUF lists dimensions innermost first; `gguf` gives the data row-major, so a matrix
of ggml shape [in, out] arrives as [out, in], which is PyTorch's `nn.Linear` layout.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

import gguf

from ....errors import ModelLoadError
from ....fit.gguf_header import StringArray, parse

_MISSING = object()


@dataclass(frozen=True)
class QuantBlocks:
    """A tensor as stored: the raw rows (a view into the memory map), its type, its shape."""

    data: np.ndarray            # [..., rows, bytes per row] for quantized types
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # logical, PyTorch order
    scale: float | None = None  # a tensor scale the blocks' values are multiplied by (ModelOpt NVFP4)


# the element types gguf gives as typed arrays; every other type arrives as rows of bytes
_TYPED = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: `data` a read-only view into the map, as `GGUFReader` gives it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # ggml order, innermost first
    data: np.ndarray


class GGUFWeights:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._meta, infos = parse(self._map)
            self.tensors = {t.name: self._view(t) for t in infos}
            if len(self.tensors) != len(infos):
                raise ValueError("a tensor name is repeated")
        except (OSError, ValueError) as e:  # truncated, malformed, empty, not a GGUF
            raise ModelLoadError(f"{self.path}: not a readable GGUF file "
                                 f"({type(e).__name__}: {e})") from None

    def _view(self, t) -> Tensor:
        qtype = gguf.GGMLQuantizationType[t.ggml_type]
        dims = tuple(reversed(t.shape))
        if t.offset + t.nbytes > len(self._map):
            raise ValueError(f"tensor {t.name!r} runs past the end of the file")
        if qtype in _TYPED:
            dtype = np.dtype(_TYPED[qtype])
            data = np.frombuffer(self._map, dtype, t.nbytes // dtype.itemsize, t.offset).reshape(dims)
        else:
            data = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
            data = data.reshape(gguf.quant_shape_to_byte_shape(dims, qtype))
        return Tensor(t.name, qtype, t.shape, data)

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (a scalar, a string, or a list); `default` when absent."""
        if key not in self._meta:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        value = self._meta[key]
        if isinstance(value, StringArray):  # the header reader keeps only the length of these
            raise ModelLoadError(f"{self.path}: metadata key {key!r} is an array of {value.length} "
                                 "values, which this runner does not read")
        return value

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
