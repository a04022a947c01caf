"""Structured output: response formats compiled to token masks with llguidance.

llguidance (Microsoft's Rust grammar engine behind Guidance) was chosen over xgrammar
because it installs as one small wheel without torch, builds its tokenizer straight from
llama.cpp's vocabulary, and computes a mask in well under a millisecond here (SmolLM2's 49k
vocabulary: ~0.2 ms). Grammars are cached per schema; each request gets its own matcher, which
the scheduler asks for the allowed tokens before sampling and feeds the sampled token after.
An invalid schema is an `InvalidRequest` at submit, before any work.
"""
from __future__ import annotations

import codecs
import json
import logging
from functools import lru_cache
from typing import Any, Callable

import numpy as np

from ...errors import InvalidRequest
from ..types import Constraint
from .special_tokens import with_special_tokens

log = logging.getLogger("appliance.engine")

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
                 piece: Callable[[int], bytes] | None = None) -> None:
        self._factory = tokenizer_factory
        self._tokenizer: Any = None
        self.n_vocab = n_vocab
        self._tokenize, self._piece = tokenize, piece   # the vocabulary: a format's special markers

    def check(self, c: Constraint) -> None:
        """A client's constraint compiles (an InvalidRequest naming it otherwise), whatever grammar
        the reply is then held to."""
        _grammar(c.kind, c.schema_json)

    def matcher(self, c: Constraint) -> Matcher:
        candidates = self._candidates(c)
        if len(candidates) > 1 and not candidates[0].is_error():
            return Matcher(candidates[0], self.n_vocab)
        m = candidates[-1]
        if m.is_error():
            param, what = {"lark": ("tools", "JSON schema"), "gbnf": ("grammar", "grammar")}.get(
                c.kind, ("response_format", "JSON schema"))
            raise InvalidRequest(f"{param}: invalid {what}: {m.get_error()}", param=param)
        return Matcher(m, self.n_vocab)

    def lazy(self, c: Constraint, begins: Callable[[str], bool], triggers: tuple[str, ...]) -> LazyMatcher:
        """A tool-call grammar held from where a call begins (`tool_choice: auto`)."""
        if self._tokenizer is None:
            self._tokenizer = self._factory()
        return LazyMatcher(self, c, begins, triggers)

    def _candidates(self, c: Constraint) -> list[Any]:
        """llguidance matchers for `c`, the preferred first: a tool call's markers as the special
        tokens they are, then as spelled out."""
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = self._factory()  # ~0.4 s once: every token's bytes
        out = []
        if c.kind == "lark" and self._tokenize is not None:
            out.append(llguidance.LLMatcher(self._tokenizer, _grammar("lark", self._marked(c.schema_json or "")),
                                            log_level=0))
        out.append(llguidance.LLMatcher(self._tokenizer, _grammar(c.kind, c.schema_json), log_level=0))
        return out

    @property
    def can_tokenize(self) -> bool:
        return self._tokenize is not None

    def tokens_of(self, text: str) -> list[int]:
        assert self._tokenize is not None
        return self._tokenize(text)

    def piece(self, tok: int) -> bytes:
        """A token's bytes (a special token's: its text)."""
        if self._piece is not None:
            return self._piece(tok)
        return bytes(self._tokenizer.decode_bytes([tok]))

    def _marked(self, lark: str) -> str:
        def specials(text: str) -> list[tuple[str, int]]:
            ids = self._tokenize(text)
            return [(self.piece(t).decode("utf-8", errors="replace"), t)
                    for t in ids if self._tokenizer.is_special_token(t)]

        return with_special_tokens(lark, specials)


class LazyMatcher:
    """`tool_choice: auto`'s grammar, as llama.cpp's lazy grammars: no mask until the reply
    begins a call (`begins`, the format's reading of the text so far), then the forced choice's
    grammar, fed what was written: the whole reply where that grammar reads it (reasoning and
    content before the calls), else the text from the call's marker. Where neither fits (a
    format whose grammar admits no text before its call, written after text), the reply goes on
    unconstrained: a lazy grammar never turns a reply into an error."""

    def __init__(self, owner: Constraints, c: Constraint, begins: Callable[[str], bool],
                 triggers: tuple[str, ...]) -> None:
        self.owner, self.c, self.begins, self.triggers = owner, c, begins, triggers
        self.n_vocab = owner.n_vocab
        self.tokens: list[int] = []
        self.text = ""            # the reply so far, read through one incremental UTF-8 decoder
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.active: Matcher | None = None
        self.given_up = False

    def allowed(self) -> np.ndarray | None:
        return self.active.allowed() if self.active is not None else None

    def accept(self, token: int) -> None:
        if self.active is not None:
            self.active.accept(token)
            return
        if self.given_up:
            return
        self.tokens.append(token)
        self.text += self.utf8.decode(self.owner.piece(token))
        if self.begins(self.text):
            self._start(self.text)

    def done(self) -> bool:
        return self.active is not None and self.active.done()

    def _start(self, text: str) -> None:
        self.given_up = True      # one try: the call has begun, fitting the grammar or not
        try:
            candidates = self.owner._candidates(self.c)
        except Exception as e:   # a tool's schema llguidance cannot use: the reply goes on as it is
            log.warning("tool_choice auto: the tools' grammar does not compile (%s); not held to it", e)
            return
        at = max((text.rfind(t) for t in self.triggers), default=-1)
        tails = [self.owner.tokens_of(text[at:])] if at >= 0 and self.owner.can_tokenize and at > 0 else []
        for ids in (self.tokens, *tails):
            for m in candidates:
                if m.is_error():
                    continue
                fresh = m.deep_copy()
                if fresh.validate_tokens(ids) == len(ids) and fresh.consume_tokens(ids) and not fresh.is_error():
                    self.active = Matcher(fresh, self.n_vocab)
                    return
        log.debug("tool_choice auto: the call's text so far does not fit the format's grammar; not held to it")
