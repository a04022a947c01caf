"""What one streamed request measured, from its event times alone (shared/BENCHMARKING.md,
rules 3 and 6). Pure arithmetic, so it is tested on synthetic streams.

    TTFT            first content byte - request sent
    prefill rate    prompt tokens computed / TTFT      (only for a request the cache did not serve)
    client decode   tokens after the first chunk / (last chunk time - first chunk time)
    engine decode   what the engine timed inside its batches (timings.predicted_per_second)

Tokens are counted from the content, not from chunks: a chunk may carry several tokens (a held
UTF-8 sequence, a stop-string candidate released at once), so the first chunk's tokens are
counted by tokenizing its text, and the whole reply's from the server's usage (or, without
usage, by tokenizing the whole content).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamTrace:
    """Raw observations of one streamed request, in perf_counter seconds."""

    t_send: float
    chunks: list[tuple[float, str]] = field(default_factory=list)   # (time, content text), non-empty text only
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    finish_reason: str | None = None
    t_end: float | None = None          # when the stream ended (its finish chunk or [DONE])
    status: int = 200
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


@dataclass(frozen=True)
class Measured:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tps: float | None         # None when the cache served part of the prompt
    client_decode_tps: float | None   # None with fewer than two chunks
    engine_decode_tps: float | None
    engine_prefill_tps: float | None
    tokens_per_step: float | None
    first_token_at: float             # perf_counter time of the first and last content chunk
    last_token_at: float


class NoContent(ValueError):
    """The stream carried no content at all: nothing to time."""


def measure(trace: StreamTrace, count_tokens: Callable[[str], int],
            prompt_tokens: int | None = None) -> Measured:
    """`prompt_tokens`: the count to use when the server reports no usage (servers without
    `stream_options.include_usage`)."""
    if not trace.chunks and (trace.status != 200 or trace.t_end is None):
        raise NoContent(f"the stream produced no content (status {trace.status}"
                        f"{', ' + trace.error if trace.error else ''})")
    # a reply that ended at once (end of generation first) has no first token: its end stands in
    first_t, first_text = trace.chunks[0] if trace.chunks else (trace.t_end, "")
    last_t = trace.chunks[-1][0] if trace.chunks else trace.t_end
    usage = trace.usage or {}
    generated = usage.get("completion_tokens")
    if generated is None:
        generated = count_tokens(trace.text)
    prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    ttft_s = first_t - trace.t_send
    after_first = generated - max(1, count_tokens(first_text))
    window = last_t - first_t
    client = after_first / window if after_first > 0 and window > 0 else None
    timings = trace.timings or {}
    engine_decode = timings.get("predicted_per_second") or None
    engine_prefill = timings.get("prompt_per_second") or None
    prefill = prompt_tokens / ttft_s if prompt_tokens and not cached and ttft_s > 0 else None
    return Measured(prompt_tokens=prompt_tokens, cached_tokens=cached, generated_tokens=int(generated),
                    ttft_ms=1000.0 * ttft_s, prefill_tps=prefill, client_decode_tps=client,
                    engine_decode_tps=engine_decode, engine_prefill_tps=engine_prefill,
                    tokens_per_step=timings.get("tokens_per_step"),
                    first_token_at=first_t, last_token_at=last_t)


def aggregate_rate(traces: Sequence[StreamTrace], count_tokens: Callable[[str], int]) -> float | None:
    """Tokens per second over all streams while every one of them decodes: from the last stream's
    first token to the first stream's last token. Each stream's chunks inside the window are
    counted by tokenizing their text together (one call per stream); None when the streams never
    all decoded at once."""
    if not traces or any(not t.chunks for t in traces):
        return None
    start = max(t.chunks[0][0] for t in traces)
    end = min(t.chunks[-1][0] for t in traces)
    if end <= start:
        return None
    n = 0
    for t in traces:
        inside = "".join(text for ts, text in t.chunks if start < ts <= end)
        n += count_tokens(inside) if inside else 0
    return n / (end - start)
