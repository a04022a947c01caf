"""Whether a tool-call grammar (Lark, llguidance) takes a text: the grammar is compiled over a
vocabulary of the 256 bytes, so any text can be fed byte by byte (no model needed, ~ms)."""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import llguidance

EOS = 256


class _Bytes:
    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def compiles(lark: str) -> bool:
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.LLMatcher.grammar_from_lark(lark))
    return not is_error


def accepts(lark: str, text: str) -> bool:
    """`text` is a whole sentence of the grammar."""
    m = llguidance.LLMatcher(tokenizer(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    if m.is_error():
        raise ValueError(m.get_error())
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


# --- the markers as special tokens -------------------------------------------------------------
# A real vocabulary makes a format's markers single special tokens, which llguidance gives no
# bytes: the engine names them in the grammar's quoted literals (output/special_tokens.py) and the
# model writes them as one token each. These do the same over the 256 bytes and `markers`.

@lru_cache(maxsize=None)
def _special_tokenizer(markers: tuple[str, ...]) -> llguidance.LLTokenizer:
    class Vocab:
        tokens = [bytes([i]) for i in range(256)] + [m.encode() for m in markers] + [b"<eos>"]
        eos_token_id = len(tokens) - 1
        bos_token_id = None
        special_token_ids = list(range(256, len(tokens)))

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def _split(text: str, markers: tuple[str, ...]) -> list[str]:
    """`text` as the markers (longest first) and the runs of text between them."""
    out, i, run = [], 0, ""
    ordered = sorted(markers, key=len, reverse=True)
    while i < len(text):
        m = next((m for m in ordered if text.startswith(m, i)), None)
        if m is None:
            run += text[i]
            i += 1
            continue
        if run:
            out.append(run)
            run = ""
        out.append(m)
        i += len(m)
    return out + ([run] if run else [])


def with_markers(lark: str, markers: Iterable[str]) -> str:
    """`lark` as the engine makes it for a vocabulary whose special tokens are `markers`."""
    from appliance.engine.output.special_tokens import with_special_tokens

    marks = tuple(markers)
    return with_special_tokens(lark, lambda text: [(p, 256 + marks.index(p)) for p in _split(text, marks) if p in marks])


def accepts_special(lark: str, text: str, markers: Iterable[str]) -> bool:
    """`text` is a whole sentence of the grammar where the model writes each of `markers` as the
    special token it is (the grammar's literals naming them as the engine names them)."""
    marks = tuple(markers)
    tok = _special_tokenizer(marks)
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(with_markers(lark, marks)), log_level=0)
    if m.is_error():
        raise ValueError(m.get_error())
    ids: list[int] = []
    for part in _split(text, marks):
        ids += [256 + marks.index(part)] if part in marks else list(part.encode())
    return m.consume_tokens(ids) and m.is_accepting()
