"""Embeddings in the engine process: requests queued, their inputs packed into batches.

    Embed command  -> Embedder.submit: texts tokenized, token ids checked, each input's length
                      checked (or cut, when the request asks); a mistake is one Error event
    a loop turn    -> Embedder.step: the oldest waiting inputs, across requests, packed into one
                      forward of at most max_tokens tokens and n_seq_max sequences
    a request done -> one `Embedded` event: its vectors (normalised as asked: L2 by default), as
                      float32; a vector per token where the request asks it and the model pools
                      none (llama-server's /embeddings), never normalised, as llama-server's

An embedding model's engine runs only this. In a chat model's engine (--embedding-model chat)
the loop runs one embeddings batch between two scheduler steps, so an embeddings request holds
the generating streams for one batch at a time (n_batch tokens, the size of a prompt chunk),
never for the whole request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from ..errors import ApplianceError, ContextOverflow, InvalidRequest
from .ipc import Embed
from .types import Embedded, Error, Event


class EmbeddingContext(Protocol):
    n_embd: int
    max_tokens: int        # per input, and per forward
    n_seq_max: int         # inputs per forward
    per_token: bool        # the model pools nothing: `embed_tokens` gives each token's vector

    def embed(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(seqs), n_embd] float32, one forward."""

    def embed_tokens(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each sequence's [len(seq), n_embd] float32 token vectors, one forward."""

    def close(self) -> None: ...


@dataclass
class _Job:
    msg: Embed
    seqs: list[tuple[int, ...]]
    per_token: bool        # answered with each token's vector (asked, and the model pools none)
    out: list[np.ndarray]  # each input's [n_embd] vector, or [n_tokens, n_embd] rows (per_token)
    sent: int = 0          # inputs handed to a forward so far
    done: int = 0


# llama-server's words for an input over the batch ("input (N tokens) is too large to process"),
# with OpenAI's ("maximum context length"): what clients match
TOO_LARGE = ("{param} ({n} tokens) is too large to process: this model's maximum context length for an "
             "embedding input is {limit} tokens; shorten it or send truncate: true to cut it")


class Embedder:
    def __init__(self, ctx: EmbeddingContext, tokenize: Callable[[str, bool], list[int]],
                 check_ids: Callable[[Sequence[int], str], None], emit: Callable[[Event], None]) -> None:
        self.ctx, self.tokenize, self.check_ids, self.emit = ctx, tokenize, check_ids, emit
        self.jobs: deque[_Job] = deque()

    def warm_up(self, tok: int) -> None:
        """One small forward, so the first request does not pay for graph allocation."""
        self.ctx.embed([(tok,) * 8])

    # -- requests --------------------------------------------------------------------------
    def submit(self, msg: Embed) -> None:
        try:
            seqs = self._inputs(msg)
        except ApplianceError as e:
            self.emit(Error(msg.request_id, *e.to_wire()))
            return
        per_token = msg.per_token and self.ctx.per_token
        self.jobs.append(_Job(msg, seqs, per_token, [np.empty(0, np.float32)] * len(seqs)))

    def _inputs(self, msg: Embed) -> list[tuple[int, ...]]:
        n_embd, limit = self.ctx.n_embd, self.ctx.max_tokens
        if msg.dimensions is not None and msg.dimensions != n_embd:
            raise InvalidRequest(f"this model's embeddings have {n_embd} dimensions and cannot be shortened; "
                                 f"send dimensions {n_embd} or none", param="dimensions")
        if not msg.inputs:
            raise InvalidRequest("there is no input to embed", param="input")
        seqs = []
        for i, item in enumerate(msg.inputs):
            param = f"input[{i}]"
            ids = self._ids(item, param)
            if not ids:
                raise InvalidRequest(f"{param} is empty: it has no tokens to embed", param=param)
            if len(ids) > limit:
                if not msg.truncate:
                    raise ContextOverflow(TOO_LARGE.format(param=param, n=len(ids), limit=limit), param=param,
                                          n_prompt_tokens=len(ids), n_ctx=limit)
                ids = ids[:limit]
            seqs.append(tuple(ids))
        return seqs

    def _ids(self, item: str | tuple[int | str, ...], param: str) -> list[int]:
        """An input's tokens: a text tokenized with the model's special tokens (its BOS), ids as
        given, a mix as llama-server takes it (the BOS only before a first piece that is text)."""
        if isinstance(item, str):
            return self.tokenize(item, True)
        ids = []
        for j, piece in enumerate(item):
            ids += self.tokenize(piece, j == 0) if isinstance(piece, str) else [piece]
        self.check_ids([t for t in item if isinstance(t, int)], param)
        return ids

    def abort(self, request_id: str) -> None:
        self.jobs = deque(j for j in self.jobs if j.msg.request_id != request_id)

    def fail_all(self, err: ApplianceError) -> None:
        for job in self.jobs:
            self.emit(Error(job.msg.request_id, *err.to_wire()))
        self.jobs.clear()

    # -- work ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.jobs)

    def step(self) -> None:
        """One forward over the oldest waiting inputs; the requests it completes are answered."""
        picked = self._pick()
        seqs = [job.seqs[i] for job, i in picked]
        vectors = self.ctx.embed_tokens(seqs) if picked[0][0].per_token else self.ctx.embed(seqs)
        for (job, i), vec in zip(picked, vectors):
            job.out[i] = vec
            job.done += 1
        while self.jobs and self.jobs[0].done == len(self.jobs[0].seqs):
            self.emit(_answer(self.jobs.popleft()))

    def _pick(self) -> list[tuple[_Job, int]]:
        """(request, input index) in arrival order while they fit one forward (the first always does)."""
        picked: list[tuple[_Job, int]] = []
        tokens = 0
        for job in self.jobs:
            while job.sent < len(job.seqs):
                n = len(job.seqs[job.sent])
                if picked and (tokens + n > self.ctx.max_tokens or len(picked) == self.ctx.n_seq_max
                               or job.per_token != picked[0][0].per_token):   # one kind a forward
                    return picked
                picked.append((job, job.sent))
                job.sent += 1
                tokens += n
        return picked

    def close(self) -> None:
        self.ctx.close()


def _answer(job: _Job) -> Embedded:
    msg = job.msg
    if job.per_token:   # as llama-server's: a pooling of none is never normalised
        vectors = np.concatenate(job.out)
    else:
        vectors = np.stack(job.out)
        if msg.normalize:
            vectors = normalized(vectors, msg.norm)
    return Embedded(msg.request_id, vectors.astype("<f4").tobytes(), vectors.shape[1],
                    tuple(len(s) for s in job.seqs), job.per_token)


def normalized(vectors: np.ndarray, p: int) -> np.ndarray:
    """Each row over its norm, as llama.cpp's common_embd_normalize: p 0 the largest magnitude
    scaled to int16's range, 1 the sum of magnitudes, 2 Euclidean, p > 2 the p-norm."""
    x = vectors.astype(np.float64)
    if p == 0:
        norms = np.abs(x).max(axis=1, keepdims=True) / 32760.0
    else:
        norms = (np.abs(x) ** p).sum(axis=1, keepdims=True) ** (1.0 / p)
    return x / np.where(norms > 0, norms, 1.0)
