"""Where the served model's multi-token-prediction (next-n) head comes from, decided from GGUF
headers before llama.cpp loads anything.

llama.cpp's converter publishes a model with an MTP head whole (the next-n block inside the
model's GGUF: "bundled") or as two files: the trunk (`convert_hf_to_gguf.py --no-mtp`) and
`mtp-NAME.gguf` (`--mtp`: the next-n block with `token_embd`, `output_norm` and `output`), which
llama-server loads as a draft model and runs in an MTP context beside the target. The head is,
in this order: `--mtp-model PATH`; the model's own block; else, for a model of an architecture
llama.cpp drafts for by MTP, the `mtp-*.gguf` beside it that `refs.sibling` picks as llama.cpp's
find_best_sibling would (the directory's files, the model's own quant tag as the tag).

A trunk may or may not still count its next-n layers: this llama.cpp's converter drops the count
with `--no-mtp` (block_count is the trunk's), other files keep it without the tensors (llama.cpp
loads those as "trunk_only"). Either way the block is looked for in the tensor table, by
llama.cpp's own probe (`blk.{trunk}.nextn.eh_proj.weight`, src/models/*.cpp): an MTP context
made against a model without it aborts the process (GGML_ASSERT "MTP block missing
nextn.eh_proj"), and some architectures (qwen35) refuse to load a trunk at all with `load_mtp`.

A sidecar must be of the model's architecture, width and vocabulary and carry the block (its
hidden rows meet the trunk's, its logits are compared with the target's). One named by
`--mtp-model` (or by the library for a pulled model) that does not is a load error; one only
found beside the model is a reason not to draft by MTP, so that a stray file in a shared folder
never stops a model from being served.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ...config import EngineConfig
from ...errors import ModelLoadError
from ...fit.gguf_header import read_header
from ...fit.model import from_header, split_parts
from ...library.refs import MTP_SIDECAR, quant_tag, sibling
from . import llamacpp_mtp

log = logging.getLogger("appliance.llamacpp")


@dataclass(frozen=True)
class HeadLayout:
    """What a GGUF's header says about its next-n head."""

    arch: str
    n_embd: int
    n_vocab: int
    n_nextn: int          # {arch}.nextn_predict_layers
    has_block: bool       # the first next-n block's tensors are in the file

    @classmethod
    def read(cls, path: Path) -> HeadLayout:
        """The layout of a GGUF (every part of a split one). OSError or ValueError when it is not
        a GGUF this can read."""
        parts = split_parts(path)
        headers = [read_header(p) for p in (parts if len(parts) > 1 and all(p.is_file() for p in parts) else [path])]
        meta, infos = headers[0][0], [t for _, ts in headers for t in ts]
        facts = from_header(path.name, meta, infos)
        n_nextn = int(meta.get(f"{facts.arch}.nextn_predict_layers", 0) or 0)
        # the trunk's blocks come first; a file that drops the count has block_count = trunk
        probe = f"blk.{facts.n_layer - n_nextn}.nextn.eh_proj.weight"
        return cls(facts.arch, facts.n_embd, facts.n_vocab, n_nextn, any(t.name == probe for t in infos))


@dataclass(frozen=True)
class HeadSource:
    """The head to draft with: the model's own block (`path` None) or a sidecar file; `refusal`
    says why there is none to draft with (then nothing is loaded for MTP)."""

    path: Path | None = None
    refusal: str | None = None

    @property
    def name(self) -> str:
        """Where the head comes from, for /health: "bundled", or the sidecar's file name."""
        return "bundled" if self.path is None else self.path.name

    @property
    def bundled(self) -> bool:
        """Whether the target is loaded with its next-n tensors (`load_mtp`)."""
        return self.refusal is None and self.path is None


def mismatch(model: HeadLayout, head: HeadLayout) -> str | None:
    """Why a sidecar's head cannot draft for this model (None: it can)."""
    if head.arch != model.arch:
        return f"it is a {head.arch} head and the model is {model.arch}"
    if not head.has_block:
        return "it carries no next-n (MTP) block (no blk.N.nextn.eh_proj.weight)"
    if head.n_embd != model.n_embd:
        return f"its width is {head.n_embd} and the model's {model.n_embd}"
    if head.n_vocab != model.n_vocab:
        return f"its vocabulary has {head.n_vocab} tokens and the model's {model.n_vocab}"
    return None


def beside(model_path: Path) -> Path | None:
    """The `mtp-*.gguf` in the model's directory that goes with it (refs.sibling's choice)."""
    names = [p.name for p in model_path.parent.glob("*.gguf") if p.is_file()]
    found = sibling(names, model_path.name, MTP_SIDECAR, quant_tag(model_path.name))
    return model_path.parent / found if found else None


def _checked(model: HeadLayout, path: Path) -> str | None:
    """Why the sidecar at `path` cannot draft for the model (None: it can)."""
    try:
        head = HeadLayout.read(path)
    except (OSError, ValueError) as e:
        return f"not a GGUF it can read ({e})"
    return mismatch(model, head) or llamacpp_mtp.why_not(head.arch, head.n_nextn)


def choose(cfg: EngineConfig, model_path: Path) -> HeadSource:
    """Where this model's MTP head comes from (module docstring); ModelLoadError for a
    --mtp-model that cannot draft for it."""
    if cfg.speculate not in ("auto", "mtp"):
        return HeadSource(refusal=f"--speculate {cfg.speculate} does not draft by MTP")
    model = HeadLayout.read(model_path)     # the placement has read it already
    if cfg.mtp_model is not None:
        path = Path(cfg.mtp_model).expanduser()
        why = "no such file" if not path.is_file() else llamacpp_mtp.why_not(model.arch, 1) or _checked(model, path)
        if why:
            raise ModelLoadError(f"--mtp-model {path}: {why}")
        return HeadSource(path)
    if model.has_block or model.arch not in llamacpp_mtp.MTP_ARCHS:
        return HeadSource(refusal=llamacpp_mtp.why_not(model.arch, model.n_nextn))
    found = beside(model_path)
    if found is None:
        return HeadSource(refusal=_no_head(model, model_path))
    why = _checked(model, found)
    if why:
        log.warning("MTP: %s beside the model is not its head: %s", found.name, why)
        return HeadSource(refusal=f"{found} beside the model cannot be its MTP head: {why}")
    return HeadSource(found, llamacpp_mtp.why_not(model.arch, 1))


def _no_head(model: HeadLayout, model_path: Path) -> str:
    """Why a model of an MTP architecture without its block has no head to draft with."""
    if model.n_nextn == 0:
        return (f"the model ({model.arch}) has no next-n (MTP) layers, and no {MTP_SIDECAR}*.gguf beside it in "
                f"{model_path.parent} carries them; MTP drafting needs a GGUF that keeps them, or the head's own "
                "file (--mtp-model PATH)")
    return (f"the model ({model.arch}) counts {model.n_nextn} next-n (MTP) layer(s) but its GGUF leaves the block "
            f"out (a trunk converted with --no-mtp), and its head's sidecar, an {MTP_SIDECAR}*.gguf (the converter's "
            f"--mtp), is not beside it in {model_path.parent}; give it with --mtp-model PATH")
