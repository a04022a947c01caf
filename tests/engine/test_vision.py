"""Images through llama.cpp's mtmd in the llama.cpp runner (runners/vision.py), on a tiny
random projector written at test time beside a tiny text model of the same width
(mmproj_fixture.py): the projector loads, a picture becomes rows of the prompt with content-
derived placeholder ids, and those rows reach the model as embeddings (the logits depend on the
picture, are the same for the same picture, and do not depend on where a prefill is cut)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.engine.prompts import PromptBuilder
from appliance.engine.runners import make_runner
from appliance.engine.runners.base import Span
from appliance.engine.runners import vision as vision_mod
from appliance.engine.runners.vision import image_ids, image_row
from appliance.engine.types import IMAGE_MARKER, ChatMessage, ImageInput, Request
from appliance.errors import InvalidRequest, ModelLoadError

from .gguf_fixtures import write_tiny
from .mmproj_fixture import N_IMAGE_TOKENS, write_mmproj, write_vision_pair


def rgb_image(seed: int, size: tuple[int, int] = (48, 40)) -> ImageInput:
    w, h = size
    px = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8).tobytes()
    return ImageInput(hashlib.sha256(f"{w}x{h}".encode() + px).hexdigest(), w, h, px)


@pytest.fixture(scope="module", params=["mlp", "gemma3"])
def vision(request, tmp_path_factory):
    """The runner with a projector of each kind: LLaVA's (causal rows) and Gemma 3's (rows that
    see each other)."""
    model, mmproj = write_vision_pair(tmp_path_factory.mktemp("vision"), kind=request.param)
    r = make_runner(EngineConfig(n_slots=2, n_ctx=256, mmproj=str(mmproj)), model, "tiny-vision")
    yield r, PromptBuilder(r, r.info)
    r.close()


def mtmd_logits(r, text: str, images: tuple[ImageInput, ...]) -> np.ndarray:
    """The reference: llama.cpp's own multimodal path (mtmd_tokenize, mtmd_helper_eval_chunks,
    as llama-server and mtmd-cli run a prompt) on a fresh context of the runner's model; the
    last position's logits."""
    import ctypes

    import llama_cpp as L
    import llama_cpp.mtmd_cpp as M

    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 2, 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if r.llamacpp.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(r.model, cp)
    raw, inp, chunks = text.encode(), M.mtmd_input_text(), M.mtmd_input_chunks_init()
    inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), True, True
    bitmaps = [M.mtmd_bitmap_init(im.width, im.height, (ctypes.c_ubyte * len(im.rgb)).from_buffer_copy(im.rgb))
               for im in images]
    try:
        assert M.mtmd_tokenize(r.projector.ctx, chunks, ctypes.byref(inp),
                               (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps), len(bitmaps)) == 0
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(r.projector.ctx, ctx, chunks, 0, 0, 256, True, ctypes.byref(n_past)) == 0
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(r.n_vocab,)).copy()
    finally:
        for bm in bitmaps:
            M.mtmd_bitmap_free(bm)
        M.mtmd_input_chunks_free(chunks)
        L.llama_free(ctx)


def ask(images: tuple[ImageInput, ...], text: str = "What is in the picture?") -> Request:
    content = "".join(IMAGE_MARKER for _ in images) + text
    return Request(id="r", messages=(ChatMessage("user", content),), images=images)


def logits_of(r, ids: list[int], cut: int | None = None, slot: int = 0) -> np.ndarray:
    r.truncate(slot, 0)
    if cut is None:
        return r.forward([Span(slot, tuple(ids), 0, 1)])[0][-1]
    r.forward([Span(slot, tuple(ids[:cut]), 0, 1)])
    return r.forward([Span(slot, tuple(ids[cut:]), cut, 1)])[0][-1]


def test_projector_loads_and_health_says_so(vision):
    r, _ = vision
    assert r.info.settings["mmproj"]["vision"] is True
    assert "mmproj=" in r.kv_fingerprint()


def test_an_image_is_its_rows_with_content_ids(vision):
    r, prompts = vision
    a = rgb_image(1)
    ids = prompts.prepare(ask((a,))).ids
    text_only = prompts.prepare(Request(id="t", messages=(ChatMessage("user", "What is in the picture?"),))).ids
    rows = [t for t in ids if t < 0]
    assert rows == image_ids(a.digest, N_IMAGE_TOKENS)
    if r.projector.non_causal:       # Gemma 3's text around a picture: <start_of_image> ... <end_of_image>
        assert len(ids) > len(text_only) + N_IMAGE_TOKENS
    else:
        assert len(ids) == len(text_only) + N_IMAGE_TOKENS
    assert [image_row(t)[1] for t in rows] == list(range(N_IMAGE_TOKENS))


def test_a_pictures_parts_and_other_pictures_have_other_ids():
    a, b = rgb_image(1).digest, rgb_image(2).digest
    rows = {tuple(image_ids(d, 4, part)) for d in (a, b) for part in (0, 1)}
    assert len({t for r in rows for t in r}) == 16 and all(t < 0 for r in rows for t in r)
    assert [image_row(t)[1] for t in image_ids(a, 4, 1)] == [0, 1, 2, 3]


def test_the_image_shapes_the_logits(vision):
    r, prompts = vision
    first = logits_of(r, prompts.prepare(ask((rgb_image(1),))).ids)
    again = logits_of(r, prompts.prepare(ask((rgb_image(1),))).ids)
    other = logits_of(r, prompts.prepare(ask((rgb_image(2),))).ids)
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 0.1


@pytest.mark.parametrize("cut", [None, 5, 21])
def test_the_logits_are_llama_cpps_own(vision, cut):
    """Whole, or cut inside the first picture or the second: the runner's prompt computes what
    llama.cpp's own multimodal path computes for it."""
    r, prompts = vision
    req = ask((rgb_image(5), rgb_image(6)))
    ids, text = prompts.prompt_ids(req)
    at = None if cut is None else ids.index(next(t for t in ids if t < 0)) + cut
    np.testing.assert_allclose(logits_of(r, ids, cut=at), mtmd_logits(r, text, req.images), rtol=1e-3, atol=1e-3)


def test_a_prefill_cut_inside_the_image_gives_the_same_logits(vision):
    r, prompts = vision
    ids = prompts.prepare(ask((rgb_image(3), rgb_image(4)))).ids
    whole = logits_of(r, ids)
    inside = ids.index(next(t for t in ids if t < 0)) + 5
    np.testing.assert_allclose(logits_of(r, ids, cut=inside, slot=1), whole, rtol=1e-4, atol=1e-4)


def test_pictures_are_held_until_their_request_ends(vision, monkeypatch):
    r, _ = vision
    p = r.projector
    monkeypatch.setattr(vision_mod, "KEEP_SPARE", 0)
    a, b, c = rgb_image(20), rgb_image(21), rgb_image(22)
    p.tokenize(IMAGE_MARKER * 2, [a, b], owner="first")
    ids = p.tokenize(IMAGE_MARKER, [c], owner="second")
    p.release("first")
    key = image_row(next(t for t in ids if t < 0))[0]
    gone = [image_row(image_ids(im.digest, 1)[0])[0] for im in (a, b)]
    assert key in p.chunks and not any(k in p.chunks for k in gone)    # the ended request's pictures went
    assert p.embeddings(key).shape == (N_IMAGE_TOKENS, p.n_embd)
    p.release("second")
    assert key not in p.chunks and key not in p.holders


def test_markers_and_images_must_agree(vision):
    _, prompts = vision
    with pytest.raises(InvalidRequest, match="2 image markers"):
        prompts.prepare(Request(id="x", messages=(ChatMessage("user", IMAGE_MARKER * 2),), images=(rgb_image(1),)))


def test_a_text_only_model_refuses_images(tmp_path):
    model = write_tiny(tmp_path / "text.gguf", "llama", n_ctx=256)
    r = make_runner(EngineConfig(n_slots=1, n_ctx=256), model, "text")
    try:
        with pytest.raises(InvalidRequest, match="does not take images"):
            PromptBuilder(r, r.info).prepare(ask((rgb_image(1),)))
    finally:
        r.close()


def test_a_projector_of_another_width_is_refused_with_the_reason(tmp_path):
    model = write_tiny(tmp_path / "m.gguf", "llama", n_ctx=256)
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", n_embd_text=96)
    with pytest.raises(ModelLoadError, match="mmproj"):
        make_runner(EngineConfig(n_slots=1, n_ctx=256, mmproj=str(mmproj)), model, "m")
