"""Structured output: response formats compiled to token masks with llguidance.

llguidance (Microsoft's Rust grammar engine behind Guidance) was chosen over xgrammar
because it installs as one small wheel without torch, builds its tokenizer straight from
llama.cpp's vocabulary, and computes a mask in well under a millisecond here (SmolLM2's 49k
vocabulary: ~0.2 ms). Grammars are cached per schema; each request gets its own matcher, which
the scheduler asks for the allowed tokens before sampling and feeds the sampled token after.
An invalid schema is an `InvalidRequest` at submit, before any work.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Callable

import numpy as np

from ...errors import InvalidRequest
from ..types import Constraint
from .special_tokens import with_special_tokens

ANY_OBJECT = {"type": "object"}


@lru_cache(maxsize=128)
def _grammar(kind: str, schema_json: str | None) -> str:
    import llguidance

    if kind == "lark":  # tool calls: a grammar written by the reply format (chat_formats/)
        return llguidance.LLMatcher.grammar_from_lark(schema_json or "")
    if kind == "gbnf":  # llama-server's `grammar`: GBNF, which llguidance reads once turned into Lark
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(schema_json or ""))
        except GbnfToLarkError as e:
            raise InvalidRequest(f"grammar: not a valid GBNF grammar: {e}", param="grammar") from None
        except RecursionError:  # its parser recurses per nesting level: a few hundred exhaust the stack
            raise InvalidRequest("grammar: the GBNF grammar nests too deeply", param="grammar") from None
    schema = ANY_OBJECT if kind == "json_object" else json.loads(schema_json or "{}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        raise InvalidRequest(f"response_format: the JSON schema is not usable: {e}",
                             param="response_format") from None


class Matcher:
    """One request's grammar state."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        import llguidance.numpy as lln

        self.m = matcher
        self.n_vocab = n_vocab
        self._fill = lln.fill_next_token_bitmask
        self._bits = lln.allocate_token_bitmask(1, n_vocab)

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary: the tokens that keep the output valid."""
        self._fill(self.m, self._bits)
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def accept(self, token: int) -> None:
        self.m.consume_token(token)

    def done(self) -> bool:
        """The grammar is complete (or failed): nothing but end-of-generation may follow."""
        return self.m.is_stopped()


class Constraints:
    def __init__(self, tokenizer_factory: Callable[[], Any], n_vocab: int,
                 tokenize: Callable[[str], list[int]] | None = None,
                 piece: Callable[[int], str] | None = None) -> None:
        self._factory = tokenizer_factory
        self._tokenizer: Any = None
        self.n_vocab = n_vocab
        self._tokenize, self._piece = tokenize, piece   # the vocabulary: a format's special markers

    def check(self, c: Constraint) -> None:
        """A client's constraint compiles (an InvalidRequest naming it otherwise), whatever grammar
        the reply is then held to."""
        _grammar(c.kind, c.schema_json)

    def matcher(self, c: Constraint) -> Matcher:
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = self._factory()  # ~0.4 s once: every token's bytes
        if c.kind == "lark" and self._tokenize is not None:   # a tool call's markers as the special tokens they are
            spelled = llguidance.LLMatcher(self._tokenizer, _grammar("lark", self._marked(c.schema_json or "")),
                                           log_level=0)
            if not spelled.is_error():
                return Matcher(spelled, self.n_vocab)
        grammar = _grammar(c.kind, c.schema_json)
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            param, what = {"lark": ("tools", "JSON schema"), "gbnf": ("grammar", "grammar")}.get(
                c.kind, ("response_format", "JSON schema"))
            raise InvalidRequest(f"{param}: invalid {what}: {m.get_error()}", param=param)
        return Matcher(m, self.n_vocab)

    def _marked(self, lark: str) -> str:
        def specials(text: str) -> list[tuple[str, int]]:
            ids = self._tokenize(text)
            return [(self._piece(t), t) for t in ids if self._tokenizer.is_special_token(t)]

        return with_special_tokens(lark, specials)
