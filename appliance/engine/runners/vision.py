"""Images into a llama.cpp model through llama.cpp's multimodal library (mtmd, `libmtmd.so`
and `llama_cpp.mtmd_cpp`, built by the same llama-cpp-python install as the runner).

How an image travels (the one path: every API's images arrive as `Request.images`):

1. The server decodes each picture to RGB (web/images.py); the prompt's text has IMAGE_MARKER
   where each goes, in order.
2. `Projector.tokenize`: mtmd cuts the text at the markers and preprocesses each picture
   (resize, normalise: the projector's own rules) into an image chunk of n rows. Text chunks
   become token ids; an image chunk becomes n *placeholder ids*, negative numbers derived from
   the picture's content hash and the row (`image_ids`). The prompt is then a list of ints like
   any other: its length counts the image's tokens, the context check and `usage` see them, and
   the prompt cache, which keys states by their ids, knows a picture by its content, so a
   follow-up turn of a conversation with the same picture reuses its KV (a different picture
   has other ids and is never mistaken for it).
3. The runner's `forward`, meeting placeholder ids in a span, decodes those rows from the
   image's embeddings (`Projector.embeddings`: mtmd's encoder runs once per picture, on first
   need; a prefix the cache restored never encodes again) in a batch of embeddings, and the
   text rows around them from tokens, in order, at their positions.

Limits: one position per image row. A projector whose model lays images out otherwise (M-RoPE
positions: Qwen2-VL and later) is refused at load, rather than served wrong. Rows attended over
non-causally (Gemma 3) are decoded together (`_decode_rows` says how a cut picture stays whole).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import llama_cpp as L
import llama_cpp.mtmd_cpp as M

from ...errors import EngineFailure, InvalidRequest, ModelLoadError
from ...models import file_fingerprint
from ..types import IMAGE_MARKER, ImageInput
from .base import Span
from .vocab import captured_log, log_to_python

log = logging.getLogger("appliance.vision")

ROW_BITS = 20          # rows an image may have (2^20); the content key takes the next 40 bits
KEEP_SPARE = 32        # preprocessed pictures no request holds, kept for a follow-up turn
KEEP_EMBEDDING_BYTES = 256 << 20   # encoded pictures kept for prompts that still need their rows (the
                                   # newest always: a big model's picture is tens of MB)


def image_ids(digest: str, n_rows: int, part: int = 0) -> list[int]:
    """The placeholder ids of the rows of part `part` of a picture (a projector that tiles a
    picture makes a chunk per slice): -(1 + key << ROW_BITS | row), all negative, so never a
    vocabulary token; the key is 40 bits of a hash of the picture's content hash and the part."""
    key = int(hashlib.sha256(f"{digest}:{part}".encode()).hexdigest()[:10], 16)
    return [-(1 + (key << ROW_BITS | row)) for row in range(n_rows)]


def image_row(token: int) -> tuple[int, int]:
    """(content key, row) of a placeholder id."""
    v = -token - 1
    return v >> ROW_BITS, v & ((1 << ROW_BITS) - 1)


class Projector:
    """A loaded mtmd context beside a llama.cpp model: tokenizes text with pictures and
    encodes pictures into the model's input embeddings."""

    def __init__(self, path: Path, model: L.llama_model_p, *, n_threads: int, use_gpu: bool,
                 flash_attn: bool, n_batch: int, n_ubatch: int) -> None:
        log_to_python(M.mtmd_log_set)
        log_to_python(M.mtmd_helper_log_set)
        p = M.mtmd_context_params_default()
        p.use_gpu, p.n_threads, p.print_timings = use_gpu, n_threads, False
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.media_marker = IMAGE_MARKER.encode()
        self.path = path
        if not Path(path).is_file():
            raise ModelLoadError(f"--mmproj {path}: no such file")
        with captured_log() as said:
            self.ctx = M.mtmd_init_from_file(str(path).encode(), model, p)
        if not self.ctx:
            raise ModelLoadError(f"--mmproj {path}: llama.cpp's mtmd could not load this projector for the "
                                 f"model{said.why()}")
        why = self._unsupported()
        if why:
            self.close()
            raise ModelLoadError(f"--mmproj {path}: {why}")
        self.n_embd = L.llama_model_n_embd_inp(model)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.n_batch, self.n_ubatch = n_batch, n_ubatch
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))   # Gemma 3: rows see each other
        self.batch = L.llama_batch_init(n_batch, self.n_embd, 1)   # rows as embeddings, not tokens
        self.fingerprint = file_fingerprint(Path(path))
        self.bytes = Path(path).stat().st_size
        self.chunks: OrderedDict[int, int] = OrderedDict()              # key -> an image chunk's copy
        self.holders: dict[int, set[str]] = {}                          # key -> requests that need it
        self.embd: OrderedDict[int, np.ndarray] = OrderedDict()         # key -> [n_rows, n_embd]
        self.encoded = 0                                                # pictures encoded (for tests, /health)

    def _unsupported(self) -> str | None:
        if not M.mtmd_support_vision(self.ctx):
            return "this projector has no vision encoder (audio is not served)"
        if M.mtmd_decode_use_mrope(self.ctx):
            return ("this model places image rows with M-RoPE (Qwen2-VL and later), which the appliance's "
                    "runner does not lay out yet")
        return None

    def describe(self) -> dict[str, object]:
        return {"path": str(self.path), "bytes": self.bytes, "vision": True, "non_causal": self.non_causal}

    # -- text and pictures -> ids --------------------------------------------------------
    def tokenize(self, text: str, images: Sequence[ImageInput], owner: str) -> list[int]:
        """The prompt's ids: text tokens, and each picture's placeholder rows where its marker is.
        Each picture is held for request `owner` until `release(owner)`."""
        n_markers = text.count(IMAGE_MARKER)
        if n_markers != len(images):
            raise InvalidRequest(f"the prompt has {n_markers} image markers ({IMAGE_MARKER}) for "
                                 f"{len(images)} images", param="messages")
        raw = text.encode()
        inp = M.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), True, True
        bitmaps = [self._bitmap(im) for im in images]
        chunks = M.mtmd_input_chunks_init()
        try:
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise InvalidRequest(f"llama.cpp's mtmd could not prepare the images (code {rc})", param="messages")
            return self._ids(chunks, owner)
        finally:
            M.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)

    def _bitmap(self, im: ImageInput) -> int:
        buf = (ctypes.c_ubyte * len(im.rgb)).from_buffer_copy(im.rgb)
        bm = M.mtmd_bitmap_init(im.width, im.height, buf)
        M.mtmd_bitmap_set_id(bm, im.digest.encode())
        return bm

    def _ids(self, chunks: int, owner: str) -> list[int]:
        ids: list[int] = []
        parts: dict[str, int] = {}       # a picture's chunks so far (its slices, for a tiling projector)
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                ids.extend(toks[j] for j in range(n.value))
                continue
            if kind != M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                raise InvalidRequest("only images are taken, not audio", param="messages")
            digest = (M.mtmd_input_chunk_get_id(chunk) or b"").decode()
            part = parts[digest] = parts.get(digest, -1) + 1
            rows = image_ids(digest, M.mtmd_input_chunk_get_n_tokens(chunk), part)
            if self.non_causal and len(rows) > self.n_ubatch:
                raise InvalidRequest(f"an image of {len(rows)} rows, which this model computes in one batch: "
                                     f"more than --n-ubatch {self.n_ubatch}", param="messages")
            self._keep_chunk(image_row(rows[0])[0], chunk, owner)
            ids.extend(rows)
        return ids

    def _keep_chunk(self, key: int, chunk: int, owner: str) -> None:
        self.holders.setdefault(key, set()).add(owner)
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return
        self.chunks[key] = M.mtmd_input_chunk_copy(chunk)

    def release(self, owner: str) -> None:
        """Request `owner` is over: its pictures are spare, the oldest past KEEP_SPARE freed."""
        for key in [k for k, who in self.holders.items() if owner in who]:
            self.holders[key].discard(owner)
            if not self.holders[key]:
                del self.holders[key]
        spare = [k for k in self.chunks if k not in self.holders]
        for key in spare[:max(0, len(spare) - KEEP_SPARE)]:
            M.mtmd_input_chunk_free(self.chunks.pop(key))

    # -- pictures -> embeddings ----------------------------------------------------------
    def embeddings(self, key: int) -> np.ndarray:
        """The picture's rows as input embeddings [n_rows, n_embd] float32, encoded on first need."""
        got = self.embd.get(key)
        if got is not None:
            self.embd.move_to_end(key)
            return got
        chunk = self.chunks.get(key)
        if chunk is None:
            raise EngineFailure("an image of a prompt being computed is no longer held by the engine")
        n = M.mtmd_input_chunk_get_n_tokens(chunk)
        if M.mtmd_encode_chunk(self.ctx, chunk) != 0:
            raise InvalidRequest("llama.cpp's mtmd could not encode an image", param="messages")
        ptr = M.mtmd_get_output_embd(self.ctx)
        got = np.ctypeslib.as_array(ptr, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
        self.encoded += 1
        self.embd[key] = got
        while len(self.embd) > 1 and sum(e.nbytes for e in self.embd.values()) > KEEP_EMBEDDING_BYTES:
            self.embd.popitem(last=False)
        return got

    # -- a span with image rows -> logits ------------------------------------------------
    def forward(self, ctx: L.llama_context_p, s: Span, decode_text: Callable[[Span], np.ndarray]) -> np.ndarray:
        """A span with image rows (placeholder ids): its runs of text tokens (`decode_text`, the
        runner's own path) and of one image's rows, decoded in turn at their positions; returns
        the logits rows the span asks for [n_logits, n_vocab], in order."""
        first_logit, rows = len(s.tokens) - s.n_logits, []
        for a, b in runs(s.tokens):
            part = Span(s.slot, s.tokens[a:b], s.start_pos + a, max(0, b - max(a, first_logit)))
            rows.append(decode_text(part) if part.tokens[0] >= 0 else self._decode_rows(ctx, part))
        return np.concatenate(rows)

    def _decode_rows(self, ctx: L.llama_context_p, part: Span) -> np.ndarray:
        """One image's rows of a span, from the picture's embeddings. Causal rows: n_batch rows
        per llama_decode. Non-causal ones (Gemma 3) each see the whole picture, so the rows from
        the span's first to the picture's last go in one batch with causal attention off and
        those past the span are dropped again: a prefill cut inside a picture computes what a
        whole one does (the rows before the cut were computed seeing the rest too)."""
        key, row0 = image_row(part.tokens[0])
        n = len(part.tokens)
        embd = self.embeddings(key)
        embd = embd[row0:len(embd) if self.non_causal else row0 + n]           # [rows, n_embd]
        want = set(range(n - part.n_logits, n))
        if not self.non_causal:
            got = [self._batch(ctx, part, start, embd[start:start + self.n_batch], want)
                   for start in range(0, n, self.n_batch)]
            return np.concatenate(got) if got else np.empty((0, self.n_vocab), np.float32)
        L.llama_set_causal_attn(ctx, False)
        try:
            got = self._batch(ctx, part, 0, embd, want)    # at most n_ubatch rows (tokenize checks)
        finally:
            L.llama_set_causal_attn(ctx, True)
        if len(embd) > n:
            L.llama_memory_seq_rm(L.llama_get_memory(ctx), part.slot, part.start_pos + n, -1)
        return got

    def _batch(self, ctx: L.llama_context_p, part: Span, start: int, embd: np.ndarray, want: set[int]) -> np.ndarray:
        """Rows start.. of the span's image run from `embd` in one llama_decode; the logits of
        those in `want` (indices in the run)."""
        b, rows = self.batch, []
        np.ctypeslib.as_array(b.embd, shape=(self.n_batch * self.n_embd,))[:embd.size] = embd.ravel()
        for j in range(len(embd)):
            b.pos[j], b.n_seq_id[j], b.seq_id[j][0] = part.start_pos + start + j, 1, part.slot
            b.logits[j] = start + j in want
            if b.logits[j]:
                rows.append(j)
        b.n_tokens = len(embd)
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc} on {len(embd)} image rows")
        got = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(self.n_vocab,)).copy() for j in rows]
        return np.stack(got) if got else np.empty((0, self.n_vocab), np.float32)

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        for chunk in getattr(self, "chunks", {}).values():
            M.mtmd_input_chunk_free(chunk)
        self.chunks = OrderedDict()
        if self.ctx:
            M.mtmd_free(self.ctx)
            self.ctx = None


def runs(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """[a, b) ranges of `tokens`: each a run of text tokens, or of one image's rows."""
    cuts, kind = [], None
    for i, t in enumerate(tokens):
        k = -1 if t >= 0 else image_row(t)[0]
        if k != kind:
            cuts.append(i)
            kind = k
    return list(zip(cuts, [*cuts[1:], len(tokens)]))
