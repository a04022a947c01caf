"""Which files of a Hub repository a pull means.

`ORG/REPO` takes the repository's only model, else its Q4_K_M (the quant llama-server's `-hf`
and Ollama default to); `ORG/REPO:QUANT` the model whose file name carries that quant tag;
`ORG/REPO FILE.gguf` that file. A split GGUF (`NAME-00001-of-00003.gguf`) is one model of all
its parts. Multimodal projectors (`mmproj*.gguf`) and draft heads' sidecars (`mtp-*.gguf`) are
not models on their own (`is_model`): `projector` finds the one a vision model's pull takes with
it, `sibling` the MTP head published beside a model whose trunk was converted without it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..fit.model import SPLIT

DEFAULT_QUANT = "Q4_K_M"
# what llama.cpp's `-hf` never takes for the model itself (common/download.cpp, gguf_filename_is_model)
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
MTP_SIDECAR = "mtp-"
PROJECTOR_QUANTS = ("F16", "BF16", "Q8_0", "F32")   # a projector's precision matters more than its size
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RefError(ValueError):
    """A reference that names nothing pullable; the message says what there is."""


@dataclass(frozen=True)
class Ref:
    repo: str
    quant: str | None = None
    file: str | None = None
    revision: str = "main"


def parse_ref(text: str, file: str | None = None, revision: str = "main") -> Ref:
    """`ORG/REPO[:QUANT]` (a `hf.co/` or `https://huggingface.co/` prefix is dropped)."""
    text = re.sub(r"^(https?://)?(hf\.co|huggingface\.co)/", "", text.strip()).rstrip("/")
    repo, _, quant = text.partition(":")
    if not _REPO.match(repo):
        raise RefError(f"'{text}' is not a Hugging Face repository: write ORG/REPO, ORG/REPO:QUANT "
                       "or ORG/REPO FILE.gguf")
    if quant and file:
        raise RefError("give a quant (ORG/REPO:QUANT) or a file, not both")
    if file is not None and not file.lower().endswith(".gguf"):
        raise RefError(f"'{file}' is not a .gguf file")
    return Ref(repo, quant or None, file, revision)


def model_name(path: str) -> str:
    """A model's name from its file: the file name without the split suffix and `.gguf`."""
    base = path.rsplit("/", 1)[-1]
    m = SPLIT.match(base)
    return m["base"] if m else base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def groups(paths: list[str]) -> dict[str, list[str]]:
    """The repository's models: key = the first file's path, value = every part in order.
    A split whose parts are not all present is left out."""
    out: dict[str, list[str]] = {}
    splits: dict[tuple[str, int], dict[int, str]] = {}
    for p in sorted(paths):
        if not is_model(p):
            continue
        m = SPLIT.match(p)
        if m is None:
            out[p] = [p]
        else:
            splits.setdefault((m["base"], int(m["count"])), {})[int(m["no"])] = p
    for (_, count), parts in splits.items():
        if sorted(parts) == list(range(1, count + 1)):
            out[parts[1]] = [parts[i] for i in range(1, count + 1)]
    return dict(sorted(out.items()))


def is_model(path: str) -> bool:
    """Whether a file is a GGUF model of its own, as llama.cpp's `-hf` judges it by the file's
    name: not a projector, an importance matrix or a draft head's sidecar (a NOT_MODELS word
    anywhere in the name, in lower case as the converters write them: `...-MTP-Q4_K_M.gguf`
    is a model that keeps its head)."""
    name = path.rpartition("/")[2]
    return name.lower().endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def has_quant(path: str, quant: str) -> bool:
    """The quant tag appears in the path as a word: `Q4_K` is not in `...-Q4_K_M.gguf`."""
    stem = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    return re.search(rf"(^|[-_./]){re.escape(quant)}($|[-./])", stem, re.IGNORECASE) is not None


def choose(ref: Ref, paths: list[str]) -> list[str]:
    """The parts of the model `ref` means, among the repository's `paths`; RefError naming the
    choices when it means none, or several."""
    models = groups(paths)
    if not models:
        raise RefError(f"{ref.repo} has no GGUF model files")
    if ref.file is not None:
        for parts in models.values():
            if ref.file in parts:
                return parts
        raise RefError(f"{ref.repo} has no file '{ref.file}'; its GGUF models: {', '.join(models)}")
    if ref.quant is None and len(models) == 1:
        return next(iter(models.values()))
    quant = ref.quant or DEFAULT_QUANT
    hits = [parts for first, parts in models.items() if has_quant(first, quant)]
    if len(hits) == 1:
        return hits[0]
    what = "several models" if hits else "no model"
    hint = "" if ref.quant else " (no quant given, so Q4_K_M was looked for)"
    listed = ", ".join([h[0] for h in hits] if hits else list(models))
    raise RefError(f"{ref.repo} has {what} for {quant}{hint}: {listed}; name one with "
                   f"ORG/REPO:QUANT or ORG/REPO FILE.gguf")


def projector(paths: list[str], model: str) -> str | None:
    """The vision projector (`mmproj*.gguf`) in the directory of the model whose first file is
    `model`: F16 first (llama.cpp's converters' default), then BF16, Q8_0, F32, else the first."""
    folder = model.rpartition("/")[0]
    found = sorted(p for p in paths if p.rpartition("/")[0] == folder and p.lower().endswith(".gguf")
                   and p.rpartition("/")[2].lower().startswith("mmproj"))
    for quant in PROJECTOR_QUANTS:
        hits = [p for p in found if has_quant(p, quant)]
        if hits:
            return hits[0]
    return found[0] if found else None


def quant_tag(path: str) -> str:
    """A GGUF's quant tag as llama.cpp reads it from the name (common/download.cpp,
    get_gguf_split_info): the last word after a `-` or `.` of the path without `.gguf` and a
    split suffix, upper case; '' where there is none (`Q4_K_M`, `BF16`, and for `Qwen3-8B`, `8B`)."""
    if not path.lower().endswith(".gguf"):
        return ""
    m = SPLIT.match(path)
    stem = m["base"] if m else path[: -len(".gguf")]
    tag = re.search(r"[-.]([A-Z0-9_]+)$", stem, re.IGNORECASE)
    return tag[1].upper() if tag else ""


def quant_bits(tag: str) -> int:
    """The bits of a quant tag as llama.cpp counts them (extract_quant_bits): the number at its
    first digit (Q4_K_M 4, BF16 16, Q8_0 8), 0 without one."""
    m = re.search(r"\d+", tag)
    return int(m[0]) if m else 0


def sibling(paths: list[str], model: str, keyword: str, tag: str = "") -> str | None:
    """The sidecar among `paths` (a repository's files, or a directory's) that goes with
    `model`, chosen as llama.cpp's find_best_sibling chooses a `-hf` model's mtp-/eagle3-/
    dflash- file (common/download.cpp): a GGUF whose name holds `keyword`, in the model's
    directory or one above it; the deepest such directory first, then one whose name carries
    `-TAG.` (the quant asked for), then the quant bits nearest the tag's (the model's own
    without a tag); the first in order of path on a tie. The keyword is looked for in the
    file's name (llama.cpp looks in the whole path)."""
    want = quant_bits(tag.upper()) if tag else quant_bits(quant_tag(model))
    folders = model.split("/")[:-1]
    best, best_key = None, None
    for p in sorted(paths):
        parts = p.split("/")
        if not p.lower().endswith(".gguf") or keyword not in parts[-1] or p == model:
            continue
        if parts[:-1] != folders[:len(parts) - 1]:
            continue        # not the model's directory, nor one above it
        exact = bool(tag) and f"-{tag.upper()}." in p.upper()
        key = (len(parts) - 1, exact, -abs(quant_bits(quant_tag(p)) - want))
        if best_key is None or key > best_key:
            best, best_key = p, key
    return best
