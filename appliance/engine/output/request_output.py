"""One request's output: from a logits row to the Delta the client sees.

    logits row --sample--> token --accept--> bytes -> UTF-8 text -> stop strings
                                              -> reasoning split -> tool calls -> Delta

`RequestOutput` owns every stage for one request: its seeded sampler, the structured-output
matcher (whose mask the sampler applies), the incremental UTF-8 decoder, the stop matcher
(which holds back text that may still become a stop string), the chat parser (reasoning
apart from content, tool calls apart from both) and the log-probabilities. The scheduler
decides which rows to sample; this decides what they say and when the request is finished.
"""
from __future__ import annotations

import codecs
from typing import Callable, Sequence

import numpy as np

from ..types import Delta, SamplingParams, TokenLogprob, TopLogprob
from .constraints import Matcher
from .dry import Dry
from .parser import OutputParser, Piece
from .sampling import Sampler, StopMatcher, log_softmax, top_ids


class RequestOutput:
    def __init__(self, request_id: str, params: SamplingParams, seed: int, limit: int,
                 eog_ids: frozenset[int], detokenize: Callable[[Sequence[int]], bytes],
                 matcher: Matcher | None = None, parser: OutputParser | None = None, index: int = 0,
                 dry: Dry | None = None, n_vocab: int = 0) -> None:
        self.id, self.params, self.limit = request_id, params, limit   # limit: most tokens it may add
        self.index = index            # its choice (a request with n > 1)
        self.eog_ids, self.detokenize = eog_ids, detokenize
        self.sampler = Sampler(params, seed, dry, n_vocab)
        self.stop = StopMatcher(params.stop)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.matcher, self.parser = matcher, parser
        self.tokens: list[int] = []
        self.stopped = False          # a stop string ended the output
        self.held: list[TokenLogprob] = []    # logprobs of tokens whose text is still held back
        self.stop_string: str | None = None   # which one

    def sample(self, row: np.ndarray) -> int:
        """The next token from this row, under the grammar's mask when there is one."""
        tok = self.sampler(row, self.matcher.allowed() if self.matcher else None)
        if self.matcher:
            self.matcher.accept(tok)
        self.tokens.append(tok)
        return tok

    def accept(self, tok: int, row: np.ndarray) -> Delta | None:
        """What the sampled token `tok` adds to the reply (None: nothing to send yet)."""
        if self.is_eog(tok):
            return None
        piece = self.detokenize([tok])
        res = self.stop.feed(self.utf8.decode(piece))
        if self.params.logprobs:
            self.held.append(self._logprobs(row, tok, piece))
        got = self.parser.feed(res.text) if self.parser is not None else Piece(res.text)
        self.stopped = res.stopped
        if res.stopped:
            self.stop_string = res.which
            self.held.clear()   # what is held made the stop string, which is not output
        if got:   # a token's logprob goes with the text it made: none travels without text
            lps, self.held = tuple(self.held), []
            return Delta(self.id, got.content, (tok,), lps, got.calls, got.reasoning, got.parts, self.index)
        return None

    def finished(self) -> str | None:
        """Why the request ends after its last token ("stop", "length"), or None."""
        if self.stopped or (self.matcher is not None and self.matcher.done()):
            return "stop"
        if self.is_eog(self.tokens[-1]):
            return "stop"
        if len(self.tokens) >= self.limit:
            return "length"
        return None

    def finish(self, reason: str) -> tuple[str, Delta | None]:
        """The request ends: what was held back is sent (text that did not become a stop string,
        an incomplete character, a tool call still open). A reply that called tools ends with
        "tool_calls"."""
        tail = "" if self.stopped else self.stop.flush() + self.utf8.decode(b"", final=True)
        got = Piece(tail)
        if self.parser is not None:
            a, b = self.parser.feed(tail), self.parser.flush()
            got = Piece(a.content + b.content, a.reasoning + b.reasoning, a.calls + b.calls, a.parts + b.parts)
            if self.parser.n_calls and reason == "stop":
                reason = "tool_calls"
        lps, self.held = tuple(self.held), []
        if not got:
            return reason, None
        return reason, Delta(self.id, got.content, (), lps, got.calls, got.reasoning, got.parts, self.index)

    @property
    def reply(self) -> tuple[int, ...]:
        """Tokens of the reply, an end-of-generation token left out unless ignore_eos."""
        return tuple(t for t in self.tokens if not self.is_eog(t))

    @property
    def n_generated(self) -> int:
        return len(self.reply)

    def is_eog(self, tok: int) -> bool:
        return tok in self.eog_ids and not self.params.ignore_eos

    def _logprobs(self, row: np.ndarray, tok: int, piece: bytes) -> TokenLogprob:
        final = self.sampler.final if self.params.post_sampling_probs else None
        if final is not None:   # the distribution drawn from; its alternatives are what the chain kept
            with np.errstate(divide="ignore"):
                lp = np.log(final)
        else:
            lp = log_softmax(row)

        def entry(t: int, raw: bytes) -> TopLogprob:
            return TopLogprob(raw.decode("utf-8", errors="replace"), tuple(raw), float(lp[t]), t)

        top = tuple(entry(int(t), self.detokenize([int(t)])) for t in top_ids(lp, self.params.top_logprobs)
                    if np.isfinite(lp[t]))
        e = entry(tok, piece)
        return TokenLogprob(e.token, e.bytes, e.logprob, top, tok)
