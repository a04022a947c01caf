"""A tiny vision projector GGUF (an "mmproj" file) written at test time, beside a tiny text
model of matching embedding size: what the multimodal tests serve, since no test may download a
vision model. Nothing here is written into the repository; callers pass a path under tmp_path.

The projector is llama.cpp's simplest, LLaVA's ("mlp" in tools/mtmd/clip.cpp): a ViT (a patch
convolution, learned position embeddings, pre-norm blocks with biased q/k/v/out and a GELU FFN)
whose second-to-last block's output goes through mm.0 -> GELU -> mm.2 into the text model's
embedding width. Fixed-size preprocessing: every image is resized to IMAGE_SIZE square, so each
image is (IMAGE_SIZE / PATCH)^2 tokens (16 here), one position each, causal: what mtmd calls
neither M-RoPE nor non-causal. Weights are random, scaled so that different pictures give
clearly different embeddings (and so different next-token logits in the text model).
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import gguf
import numpy as np

from .gguf_fixtures import write_tiny

IMAGE_SIZE = 32
PATCH = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def write_mmproj(path: os.PathLike[str] | str, *, n_embd_text: int = 64, n_embd: int = 32,
                 n_layer: int = 2, n_head: int = 4, n_ff: int = 64, seed: int = 1, kind: str = "mlp") -> Path:
    """Write an F32 projector whose output is `n_embd_text` wide; returns the path. kind "mlp"
    (LLaVA's), or "gemma3": Gemma 3's (the same ViT, its patches average-pooled 2 x 2, RMS-normed
    and projected), whose rows llama.cpp attends over non-causally; N_IMAGE_TOKENS rows either way."""
    patch = PATCH if kind == "mlp" else PATCH // 2      # gemma3 pools 2 x 2 patches into a row
    rng = np.random.default_rng(seed)

    def rand(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    path = Path(path)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("tiny-random-mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", kind)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", n_embd_text), ("attention.head_count", n_head)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", patch)
    if kind == "gemma3":
        w.add_uint32("clip.vision.projector.scale_factor", 2)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    # numpy order (GGUF reverses it): the patch convolution is [n_embd, 3, PATCH, PATCH]
    w.add_tensor("v.patch_embd.weight", rand(n_embd, 3, patch, patch))
    w.add_tensor("v.position_embd.weight", rand((IMAGE_SIZE // patch) ** 2, n_embd))
    for i in range(n_layer):
        p = f"v.blk.{i}."
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + t + ".weight", rand(n_embd, n_embd))
            w.add_tensor(p + t + ".bias", rand(n_embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(p + t + ".weight", np.ones(n_embd, np.float32))
            w.add_tensor(p + t + ".bias", np.zeros(n_embd, np.float32))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.bias", rand(n_ff))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(p + "ffn_down.bias", rand(n_embd))
    # the projection's output is added to nothing: at std 1 it is as large as a token embedding
    if kind == "gemma3":
        w.add_tensor("mm.soft_emb_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor("mm.input_projection.weight", rand(n_embd, n_embd_text, std=0.5))
    else:
        w.add_tensor("mm.0.weight", rand(n_embd_text, n_embd, std=0.5))
        w.add_tensor("mm.0.bias", rand(n_embd_text))
        w.add_tensor("mm.2.weight", rand(n_embd_text, n_embd_text, std=0.5))
        w.add_tensor("mm.2.bias", rand(n_embd_text))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_vision_pair(directory: os.PathLike[str] | str, *, n_ctx: int = 512, kind: str = "mlp") -> tuple[Path, Path]:
    """(a tiny llama text model, its projector of `kind`) in `directory`: the model's logits
    mean something (`write_tiny`'s scales), so an image changes the reply."""
    d = Path(directory)
    model = write_tiny(d / "tiny-vision.gguf", "llama", n_ctx=n_ctx, name="tiny-vision")
    return model, write_mmproj(d / f"mmproj-tiny-vision-{kind}.gguf", kind=kind)


def picture(kind: str = "noise", *, size: tuple[int, int] = (48, 40), seed: int = 0, fmt: str = "PNG") -> bytes:
    """An encoded image: "noise" (random pixels of `seed`) or a solid colour name ("red")."""
    from PIL import Image

    if kind == "noise":
        px = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
        img = Image.fromarray(px)
    else:
        img = Image.new("RGB", size, kind)
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()
