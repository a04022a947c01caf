"""Embeddings in the engine process: requests queued, their inputs packed into batches.

    Embed command  -> Embedder.submit: texts tokenized, token ids checked, each input's length
                      checked (or cut, when the request asks); a mistake is one Error event
    a loop turn    -> Embedder.step: the oldest waiting inputs, across requests, packed into one
                      forward of at most max_tokens tokens and n_seq_max sequences
    a request done -> one `Embedded` event: its vectors, L2-normalised, as float32

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

    def embed(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(seqs), n_embd] float32, one forward."""

    def close(self) -> None: ...


@dataclass
class _Job:
    msg: Embed
    seqs: list[tuple[int, ...]]
    out: np.ndarray        # [len(seqs), n_embd]
    sent: int = 0          # inputs handed to a forward so far
    done: int = 0


class Embedder:
    def __init__(self, ctx: EmbeddingContext, tokenize: Callable[[str], list[int]],
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
        self.jobs.append(_Job(msg, seqs, np.empty((len(seqs), self.ctx.n_embd), np.float32)))

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
            if isinstance(item, str):
                ids = self.tokenize(item)
            else:
                ids = list(item)
                self.check_ids(ids, param)
            if not ids:
                raise InvalidRequest(f"{param} is empty: it has no tokens to embed", param=param)
            if len(ids) > limit:
                if not msg.truncate:
                    raise ContextOverflow(f"{param} has {len(ids)} tokens, more than the {limit} this model "
                                          "embeds at once", param=param, n_prompt_tokens=len(ids), n_ctx=limit)
                ids = ids[:limit]
            seqs.append(tuple(ids))
        return seqs

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
        vectors = self.ctx.embed([job.seqs[i] for job, i in picked])
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
                if picked and (tokens + n > self.ctx.max_tokens or len(picked) == self.ctx.n_seq_max):
                    return picked
                picked.append((job, job.sent))
                job.sent += 1
                tokens += n
        return picked

    def close(self) -> None:
        self.ctx.close()


def _answer(job: _Job) -> Embedded:
    vectors = job.out
    if job.msg.normalize:
        norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1.0)
    return Embedded(job.msg.request_id, vectors.astype("<f4").tobytes(), vectors.shape[1],
                    tuple(len(s) for s in job.seqs))
