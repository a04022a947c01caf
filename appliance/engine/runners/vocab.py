"""A GGUF's vocabulary through llama.cpp: tokenize, detokenize, special tokens, chat template.

Both runners use it, so the same text becomes the same token ids whatever computes the
logits: the llama.cpp runner over its loaded model, the torch runner over a vocab-only load
of the same file (no weights are read).
"""
from __future__ import annotations

import ctypes
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import llama_cpp as L

from ...errors import ModelLoadError
from .base import FimTokens

log = logging.getLogger("appliance.llamacpp")
log.setLevel(logging.WARNING)  # llama.cpp's info and debug lines only when asked for (tests, --log-level is not enough)

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


class LoadLog:
    """llama.cpp's info, warning and error lines while `captured_log` runs."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.errors: list[str] = []

    def why(self) -> str:
        """llama.cpp's own errors, to end a load failure's message with (empty if it gave none)."""
        said = "; ".join(e.strip() for e in self.errors[-4:])
        return f"; llama.cpp said: {said}" if said else ""


_captured: LoadLog | None = None


@L.llama_log_callback
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    lvl = _LEVELS.get(level, logging.DEBUG)
    if _captured is not None and lvl >= logging.INFO:
        _captured.lines.append(text.decode(errors="replace"))
        if lvl >= logging.ERROR:
            _captured.errors.append(text.decode(errors="replace"))
    if log.isEnabledFor(lvl):
        log.log(lvl, "%s", text.decode(errors="replace").rstrip())


@contextmanager
def captured_log() -> Iterator[LoadLog]:
    """llama.cpp's lines while the block runs, whatever the logger's level: what it says it
    allocated at load, and why a load failed (the engine loads in one thread)."""
    global _captured
    _captured = said = LoadLog()
    try:
        yield said
    finally:
        _captured = None


def log_to_python(set_log: Callable[..., None]) -> None:
    """Route a llama.cpp library's log (llama's, mtmd's) through this module's logger."""
    set_log(_log_callback, ctypes.c_void_p(0))


def init_backend() -> None:
    log_to_python(L.llama_log_set)
    L.llama_backend_init()


def load_model(path: Path, vocab_only: bool = False,
               params: L.llama_model_params | None = None) -> L.llama_model_p:
    """Load a GGUF: with `params` (the runner's placement), else everything in host memory."""
    init_backend()
    mp = params if params is not None else L.llama_model_default_params()
    if params is None:
        mp.n_gpu_layers = 0
    mp.vocab_only = vocab_only
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ModelLoadError(f"{path}: llama.cpp could not load this file as a GGUF model")
    return model


def meta(model: L.llama_model_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else None


class Vocab:
    """The vocabulary of a loaded llama.cpp model (which the caller owns and frees)."""

    def __init__(self, model: L.llama_model_p) -> None:
        self.model = model
        self.vocab = L.llama_model_get_vocab(model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._piece = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}   # each token's piece, asked once: a step detokenizes its token

    # -- model facts ---------------------------------------------------------------------
    def opt_token(self, tok: int) -> int | None:
        return tok if 0 <= tok < self.n_vocab else None

    def text_of(self, tok: int) -> str:
        return self.detokenize([tok]).decode(errors="replace") if self.opt_token(tok) is not None else ""

    def eog_ids(self) -> frozenset[int]:
        return frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))

    def chat_template(self) -> str | None:
        raw = L.llama_model_chat_template(self.model, None)
        return raw.decode(errors="replace") if raw else None

    def facts(self) -> dict:
        """The RunnerInfo fields that come from the vocabulary."""
        bos, eos = L.llama_vocab_bos(self.vocab), L.llama_vocab_eos(self.vocab)
        return {"n_vocab": self.n_vocab, "eog_ids": self.eog_ids(), "bos_id": self.opt_token(bos),
                "add_bos": bool(L.llama_vocab_get_add_bos(self.vocab)),
                "chat_template": self.chat_template(), "bos_text": self.text_of(bos),
                "eos_text": self.text_of(eos), "fim": self.fim_tokens()}

    def fim_tokens(self) -> FimTokens:
        v, tok = self.vocab, self.opt_token
        return FimTokens(tok(L.llama_vocab_fim_pre(v)), tok(L.llama_vocab_fim_suf(v)), tok(L.llama_vocab_fim_mid(v)),
                         tok(L.llama_vocab_fim_rep(v)), tok(L.llama_vocab_fim_sep(v)))

    # -- text ----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode()
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> bytes:
        pieces = self._pieces
        if len(ids) == 1 and (one := pieces.get(ids[0])) is not None:   # a decode step's one token
            return one
        out = bytearray()
        for tok in ids:
            got = pieces.get(tok)
            if got is None:
                got = self._token_piece(tok)
                if 0 <= tok < self.n_vocab:
                    pieces[tok] = got
            out += got
        return bytes(out)

    def _token_piece(self, tok: int) -> bytes:
        n = L.llama_token_to_piece(self.vocab, tok, self._piece, len(self._piece), 0, True)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, tok, big, -n, 0, True)
            return big.raw[:n]
        return self._piece.raw[:n]

    def guidance_tokenizer(self):
        """llguidance's view of this vocabulary, for structured output (built on first use)."""
        import warnings

        import llguidance.llamacpp

        with warnings.catch_warnings():   # it asks every token's attributes by llama-cpp-python's deprecated name
            warnings.simplefilter("ignore", DeprecationWarning)
            return llguidance.llamacpp.lltokenizer_from_vocab(self.vocab, eos_token=sorted(self.eog_ids()))


class TextMethods:
    """The protocol's text methods for a runner whose `text` is a `Vocab`."""

    text: Vocab

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.text.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self.text.detokenize(ids)

    def guidance_tokenizer(self):
        return self.text.guidance_tokenizer()
