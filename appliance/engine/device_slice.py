"""The device check's partial model: the first and last layers and the output head of a GGUF,
written as a model of its own (issue 72).

When the whole model's CPU side does not fit in the free memory (a 70B on a 64 GB APU), the
device check still compares what fits: a copy of the file holding the token embeddings, the
first EDGE and last EDGE blocks (renumbered 0..k-1), the output norm and the output head, with
`block_count` set to k. The device runs it with every layer on it and the CPU backend runs it too;
both compute the same function of the same tensor bytes with their own kernels, which is what the
check asks (llama.cpp issue #28211's garbage on gfx1151 showed in every layer and in the head).

Metadata that holds one value per layer (head counts, feed-forward lengths, sliding-window
patterns: an array as long as block_count) is cut to the kept layers; a DeepSeek-style
`leading_dense_block_count` counts the kept dense layers; MTP layers (`nextn_predict_layers`,
the last blocks of GLM and DeepSeek files) are kept whole. An architecture that decides a layer's
kind from its index (a hybrid's attention every N layers) may not load renumbered: the check then
says it was skipped and why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf

EDGE = 2                              # blocks kept at each end
BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Slice:
    """What a partial model holds."""

    keep: tuple[int, ...]            # the source's block indices, in order
    n_layer: int                     # the source's block count
    nbytes: int                      # tensor bytes the slice holds

    def describe(self) -> str:
        return f"layers {', '.join(map(str, self.keep))} of {self.n_layer} and the output head"


def _arch_int(reader: gguf.GGUFReader, arch: str, key: str, default: int = 0) -> int:
    f = reader.fields.get(f"{arch}.{key}")
    return default if f is None else int(f.contents())


def plan(reader: gguf.GGUFReader, edge: int = EDGE) -> Slice:
    """The blocks a partial model of `reader`'s file keeps, and their bytes with the rest."""
    arch = str(reader.fields["general.architecture"].contents())
    n_layer = _arch_int(reader, arch, "block_count")
    nextn = _arch_int(reader, arch, "nextn_predict_layers")
    main = n_layer - nextn
    keep = tuple(sorted({*range(min(edge, main)), *range(max(0, main - edge), main), *range(main, n_layer)}))
    kept = set(keep)
    nbytes = 0
    for t in reader.tensors:
        m = BLOCK.match(t.name)
        if m is None or int(m.group(1)) in kept:
            nbytes += int(t.n_bytes)
    return Slice(keep, n_layer, nbytes)


def write(src: Path, dst: Path, edge: int = EDGE) -> Slice:
    """Write the partial model of `src` to `dst` (through `dst`.part); the tensors' bytes are
    copied as stored, quantized or not."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    cut = plan(reader, edge)
    renumber = {old: new for new, old in enumerate(cut.keep)}
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes the header and the architecture itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = len(cut.keep)
        elif field.name == f"{arch}.leading_dense_block_count":
            value = sum(1 for i in cut.keep if i < int(value))
        elif field.name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == cut.n_layer:
            value = [value[i] for i in cut.keep]          # one value per layer
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        m = BLOCK.match(t.name)
        if m is not None and int(m.group(1)) not in renumber:
            continue
        name = t.name if m is None else f"blk.{renumber[int(m.group(1))]}.{m.group(2)}"
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            m = BLOCK.match(t.name)
            if m is None or int(m.group(1)) in renumber:
                writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    finally:
        writer.close()
    tmp.replace(dst)
    return cut
