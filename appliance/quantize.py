"""`appliance quantize --to FORMAT IN.gguf OUT.gguf`: a copy of a GGUF model with its weight
matrices in another block format, and, with `--report`, its quality against the source.

Every tensor of two or more dimensions named `*.weight` whose rows hold whole blocks of the
target is dequantized (`gguf`) and quantized again: NVFP4 by `kernels.formats`' quantizer
(neither `gguf` nor llama.cpp 0.3.36 writes NVFP4), the others by `gguf.quants.quantize`.
Norms, biases, the MoE router (`ffn_gate_inp`) and tensors already in the target format are
copied byte for byte; so is every metadata key, but `general.file_type`. The K-quant mixes
(`q4_k_m`, `q5_k_m`, `q6_k`) are llama.cpp's own: its quantizer (`llama_model_quantize`)
writes them as `llama-quantize` would, choosing each tensor's type (a Q4_K_M keeps some in Q6_K).

The report runs both files in llama.cpp, which reads every one of these formats on its own
kernels (an independent decoder of what this writes), teacher-forced over a fixed text: the
share of positions whose next-token argmax agrees, and the mean KL(source || copy).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import gguf

from .errors import ApplianceError

T = gguf.GGMLQuantizationType
TARGETS = {"nvfp4": (T.NVFP4, gguf.LlamaFileType.MOSTLY_NVFP4),
           "mxfp4": (T.MXFP4, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
           "q4_0": (T.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
           "q4_1": (T.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
           "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
# written by llama.cpp's quantizer: its llama_ftype numbers (LLAMA_FTYPE_MOSTLY_*)
LLAMA_TARGETS = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
KEEP = ("_norm", "norm.", "ffn_gate_inp")   # name parts of tensors copied as they are
REPORT_TOKENS, REPORT_CHUNK = 256, 64


class QuantizeError(ApplianceError):
    pass


@dataclass
class Summary:
    source: str
    output: str
    to: str
    converted: int
    copied: int
    bytes_before: int
    bytes_after: int
    seconds: float
    argmax_agreement: float | None = None
    mean_kl: float | None = None
    report_tokens: int = 0


def _converts(t, qtype: T) -> bool:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    shape = [int(d) for d in t.shape]                  # ggml order: innermost first
    return (len(shape) >= 2 and t.name.endswith(".weight") and t.tensor_type != qtype
            and shape[0] % block == 0 and not any(k in t.name for k in KEEP))


def _quantize(values: np.ndarray, qtype: T) -> np.ndarray:
    rows = values.reshape(-1, values.shape[-1])
    if qtype == T.NVFP4:
        import torch

        from kernels.formats import quantize_nvfp4_torch

        out = quantize_nvfp4_torch(torch.tensor(rows)).numpy()   # a copy: F32 rows are a read-only map
    else:
        out = gguf.quants.quantize(rows, qtype)
    return out.reshape(*values.shape[:-1], out.shape[-1])


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer writes the header, the architecture and the file type itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(file_type)


def quantize_file(src: Path, dst: Path, to: str) -> Summary:
    if to not in TARGETS and to not in LLAMA_TARGETS:
        raise QuantizeError(f"--to must be one of {', '.join([*TARGETS, *LLAMA_TARGETS])}, not {to!r}")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise QuantizeError("the output must be another file than the source")
    if to in LLAMA_TARGETS:
        return llama_quantize(src, dst, to)
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{src}: not a readable GGUF file ({e})") from None
    qtype, file_type = TARGETS[to]
    arch = str(reader.fields["general.architecture"].contents())
    t0 = time.perf_counter()
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer, int(file_type))
    converted = copied = before = after = 0
    for t in reader.tensors:
        before += int(t.n_bytes)
        if _converts(t, qtype):
            data = _quantize(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32), qtype)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
            converted += 1
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)   # bytes as stored
            copied += 1
        after += int(writer.tensors[-1][t.name].nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return Summary(str(src), str(dst), to, converted, copied, before, after, time.perf_counter() - t0)


def llama_quantize(src: Path, dst: Path, to: str) -> Summary:
    """`to`, one of LLAMA_TARGETS, written by llama.cpp's quantizer (it may requantize a
    quantized source: its quality is then bounded by the source's)."""
    import llama_cpp as L

    from .fit.gguf_header import read_header

    try:
        before = read_header(src)[1]
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{src}: not a readable GGUF file ({e})") from None
    params = L.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = LLAMA_TARGETS[to], True
    t0, tmp = time.perf_counter(), dst.with_name(dst.name + ".part")
    if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama.cpp's quantizer could not write {to} from {src} (its log above says why)")
    tmp.replace(dst)
    after = read_header(dst)[1]
    was = {t.name: t.ggml_type for t in before}
    changed = sum(t.ggml_type != was.get(t.name) for t in after)
    return Summary(str(src), str(dst), to, changed, len(after) - changed, sum(t.nbytes for t in before),
                   sum(t.nbytes for t in after), time.perf_counter() - t0)


def quality(src: Path, dst: Path, text: str, n_tokens: int = REPORT_TOKENS) -> tuple[float, float, int]:
    """(argmax agreement, mean KL(src || dst), tokens) of llama.cpp teacher-forced over `text`."""
    from .config import EngineConfig
    from .engine.runners import make_runner

    cfg = EngineConfig(n_slots=1, n_ctx=max(512, n_tokens), engine="llamacpp")
    runs = []
    for path in (src, dst):
        r = make_runner(cfg, Path(path), "quantize")
        try:
            ids = r.tokenize(text, add_special=True)[:n_tokens]
            runs.append(teacher_forced(r, ids))
        finally:
            r.close()
    return (*agreement(*runs), len(runs[0]))


def teacher_forced(r, ids: list[int], chunk: int = REPORT_CHUNK) -> np.ndarray:
    """Every position's next-token logits from runner `r`, the text fed in chunks: [len(ids), V]."""
    from .engine.runners.base import Span

    r.truncate(0, 0)
    rows = [r.forward([Span(0, tuple(ids[i:i + chunk]), i, len(ids[i:i + chunk]))])[0]
            for i in range(0, len(ids), chunk)]
    return np.concatenate(rows)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(share of positions with the same argmax, mean KL(ref || got))."""
    lr, lg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(-1)
    return float((ref.argmax(-1) == got.argmax(-1)).mean()), float(kl.mean())


# -- the command ---------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a copy of a GGUF model with its weights in another format",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="IN", help="a GGUF file, or 'embedded' for the embedded model")
    p.add_argument("output", metavar="OUT", help="the GGUF file to write")
    p.add_argument("--to", required=True, choices=sorted([*TARGETS, *LLAMA_TARGETS]),
                   help="the weights' block format (q4_k_m, q5_k_m, q6_k: llama.cpp's own quantizer)")
    p.add_argument("--report", action="store_true",
                   help="also measure the copy against the source in llama.cpp (argmax agreement, mean KL)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .models import embedded_model_path

    src = embedded_model_path() if args.source == "embedded" else Path(args.source)
    try:
        s = quantize_file(src, Path(args.output), args.to)
        if args.report:
            from .bench.prompt_sets import filler_paragraphs

            text = "\n\n".join(filler_paragraphs())
            s.argmax_agreement, s.mean_kl, s.report_tokens = quality(src, Path(args.output), text)
    except ApplianceError as e:
        print(f"appliance quantize: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(s), indent=2))
        return 0
    print(f"{s.output}: {s.converted} tensors to {s.to}, {s.copied} copied; "
          f"{s.bytes_before / 2**20:.1f} -> {s.bytes_after / 2**20:.1f} MiB in {s.seconds:.1f} s")
    if s.mean_kl is not None:
        print(f"against {s.source} in llama.cpp, {s.report_tokens} tokens teacher-forced: "
              f"argmax agreement {100 * s.argmax_agreement:.1f}%, mean KL {s.mean_kl:.4f}")
    return 0
