"""Whether a tool-call grammar (Lark, llguidance) takes a text: the grammar is compiled over a
vocabulary of the 256 bytes, so any text can be fed byte by byte (no model needed, ~ms)."""
from __future__ import annotations

from functools import lru_cache

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
