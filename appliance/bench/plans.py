"""What `sweep` and `bench` measure: each builds a plan of steps (session.Step) over the
variants (one server, or A and B) and the raw reference (context.py: what plans are built
from; agent.py: bench's agent replay).

Order inside a repeat alternates what is compared: raw then served on even repeats, served then
raw on odd ones; A then B always (shared/BENCHMARKING.md, rule 7). The same token sequence is
given to raw and served (and to A and B) within a repeat; every repeat draws a fresh nonce.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import secrets
import string
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..store import ResultCell
from . import prompt_sets
from .agent import agent_steps
from .client import BenchError, CellFailed
from .energy import shared_energy
from .context import CHAT, COMPLETIONS, BenchOptions, Context, once
from .session import Phases, Step, Variant, nonce, raw_cells, served_cell, to_cell
from .timing import aggregate_rate, measure


def _ordered(repeat: int, served: list[Step], raw: list[Step]) -> list[Step]:
    return raw + served if repeat % 2 == 0 else served + raw


def alternated(per_variant: Sequence[Sequence[Step]]) -> list[Step]:
    """The variants' step lists taken one step of each at a time, A B then B A (rule 7): an
    A/B agent replay measures both sides' turn k of a conversation within seconds of each
    other, whatever the machine drifts meanwhile."""
    out: list[Step] = []
    for i in range(max(map(len, per_variant), default=0)):
        out += [s[i] for s in (per_variant if i % 2 == 0 else per_variant[::-1]) if i < len(s)]
    return out


def _rate_body(n_gen: int) -> dict[str, Any]:
    # exactly n_gen tokens: a rate measured over a reply that stopped early means nothing
    return {"max_tokens": n_gen, "temperature": 0, "ignore_eos": True}


def _prompt(v: Variant, ids: list[int]) -> list[int] | str:
    """The token ids themselves where the server takes them, else their text (re-tokenized by
    the server, so the count may differ by a token or two: the cell records what it got)."""
    if v.target.accepts_token_prompts(v.model_id):
        return ids
    text = v.target.detokenize(ids)
    if text is None:
        raise CellFailed(f"{v.target.url} takes no token-id prompts and cannot detokenize")
    return text


def _served_ids_step(ctx: Context, v: Variant, label: str, r: int, ids: Callable[[], list[int]],
                     n_gen: int, kind: str, prompt_set: str, cache_on: bool = False,
                     pair: dict | None = None) -> Step:
    def run() -> list[ResultCell]:
        cell, trace, _ = served_cell(v, COMPLETIONS, {"prompt": _prompt(v, ids()), **_rate_body(n_gen)}, ctx.sampler,
                                     prompt_set=prompt_set, kind=kind, repeat_index=r, cache_on=cache_on,
                                     extra={"cell": label})
        return [_with_identity(cell, pair, "served", [trace.text])]
    return Step(label, r, v.label, "served", run)


def _raw_ids_step(ctx: Context, label: str, r: int, seqs: Callable[[], list[list[int]]], n_gen: int,
                  kind: str, prompt_set: str, concurrency: int = 1, pair: dict | None = None) -> Step:
    def run() -> list[ResultCell]:
        cells, result = raw_cells(ctx.raw, seqs(), n_gen, ctx.sampler, prompt_set=prompt_set,
                                  extra={"cell": label}, kind=kind, repeat_index=r, concurrency=concurrency)
        texts = [ctx.prompts.target.detokenize(t) for t in result.tokens]
        return [_with_identity(c, pair, "raw", texts) for c in cells]
    return Step(label, r, "", "raw", run)


def _with_identity(cell: ResultCell, pair: dict | None, side: str, texts: list[str | None]) -> ResultCell:
    """Greedy served output must be llama.cpp's own, token for token (rule 12): the second of a
    raw/served pair to finish compares the two texts and records the verdict on its cells."""
    if pair is None or any(t is None for t in texts):
        return cell
    pair[side] = texts
    other = pair.get("raw" if side == "served" else "served")
    if other is None:
        return cell
    i = cell.extra.get("stream", 0)
    return dataclasses.replace(cell, extra={**cell.extra, "identity": other[i] == texts[i]})


def check_fits(ctx: Context, n_prompt: int, n_gen: int, what: str) -> None:
    if ctx.n_ctx and n_prompt + n_gen > ctx.n_ctx:
        raise BenchError(f"{what}: {n_prompt} prompt + {n_gen} generated tokens do not fit the "
                         f"server's context of {ctx.n_ctx} per slot (serve with a larger --n-ctx)")


# -- sweep -----------------------------------------------------------------------------------

def sweep_plan(ctx: Context, sizes: Sequence[int], n_gen: int, runs: int, cache: bool) -> list[Step]:
    """For each prompt size: TTFT and prefill rate, then client and engine decode at that depth;
    with cache on, the same prompt again, served from the prompt cache, as its own row."""
    for p in sizes:
        check_fits(ctx, p, n_gen, f"sweep p={p}")
    steps: list[Step] = []
    for r in range(runs):
        for p in sizes:
            label = f"sweep p={p}"
            ids = once(lambda p=p: ctx.prompts.ids(p))
            pair: dict = {}
            served = [_served_ids_step(ctx, v, label, r, ids, n_gen, "sweep", "sweep", pair=pair)
                      for v in ctx.variants]
            raw = ([_raw_ids_step(ctx, label, r, lambda ids=ids: [ids()], n_gen, "sweep", "sweep", pair=pair)]
                   if ctx.raw else [])
            steps += _ordered(r, served, raw)
            if cache:
                steps += [_served_ids_step(ctx, v, f"sweep p={p} cached", r, ids, n_gen, "sweep", "sweep",
                                           cache_on=True) for v in ctx.variants]
    return steps


# -- bench -----------------------------------------------------------------------------------

SUPPORTED_MODES = ("serial", "lookup", "draft", "mtp")


def bench_plan(ctx: Context, o: BenchOptions) -> list[Step]:
    offers = _offered_modes(ctx, o.modes)
    sets = [prompt_sets.load(name) for name in o.prompt_sets]
    depths = () if o.depths is None else (o.depths or ((ctx.n_ctx // 2,) if ctx.n_ctx else (4096,)))
    for d in depths:
        check_fits(ctx, d, o.tokens, f"depth {d}")
    levels = [c for c in o.concurrency if c >= 1]
    too_many = [c for c in levels if c > ctx.n_slots]
    if too_many:
        raise BenchError(f"--concurrency {too_many[0]} is more than the server's {ctx.n_slots} slots")
    steps: list[Step] = []
    for r in range(o.runs):
        for ps in sets:  # the modes side by side per prompt, their order alternating per repeat
            for mode in (o.modes if r % 2 == 0 else o.modes[::-1]):
                steps += [_chat_step(ctx, v, ps, r, mode, o.tokens) for v in ctx.variants if mode in offers[v.label]]
        for d in depths:
            steps += [_depth_step(ctx, v, d, r, o.tokens) for v in ctx.variants]
        for c in levels:
            label = f"concurrency {c}"
            seqs = once(lambda c=c: [ctx.prompts.ids(o.concurrency_prompt_tokens) for _ in range(c)])
            pair: dict = {}
            served = [_concurrent_step(ctx, v, label, r, seqs, o.tokens, pair) for v in ctx.variants]
            raw = ([_raw_ids_step(ctx, label, r, seqs, o.tokens, "concurrency", "sweep", concurrency=c, pair=pair)]
                   if ctx.raw else [])
            steps += _ordered(r, served, raw)
    steps += alternated([agent_steps(ctx, v, o) for v in ctx.variants])
    lengths = o.needle_lengths
    if lengths is None:
        lengths = tuple(int(ctx.n_ctx * f) for f in (0.25, 0.5, 0.9)) + (int(ctx.n_ctx * 1.1),) if ctx.n_ctx else ()
    for v in ctx.variants:
        steps += [_needle_step(ctx, v, n) for n in lengths]
    return steps


def _offered_modes(ctx: Context, modes: Sequence[str]) -> dict[str, set[str]]:
    """The modes each variant is measured in. A mode no variant offers is an error that says
    why; in an A/B run, a mode one side refuses (lookup on a runner that is not exact, draft
    without a draft model) is measured on the other side only, and said so."""
    offers: dict[str, set[str]] = {v.label: {"serial"} for v in ctx.variants}
    for mode in modes:
        if mode not in SUPPORTED_MODES:
            raise BenchError(f"mode {mode!r} is not available (modes: {', '.join(SUPPORTED_MODES)})")
        if mode == "serial":
            continue
        refusals = []
        for v in ctx.variants:
            spec = ((v.health or {}).get("settings") or {}).get("speculation")
            if spec is None:
                refusals.append(f"{v.target.url} does not report speculation in /health (not an appliance server)")
            elif mode not in spec.get("modes", ()):
                why = ("it has no draft model (serve with --draft-model)" if mode == "draft" and spec.get("modes")
                       else spec["mtp_refusal"] if mode == "mtp" and spec.get("mtp_refusal")
                       else spec.get("reason", "it does not speculate"))
                refusals.append(f"{v.target.url} refuses it: {why}")
            else:
                offers[v.label].add(mode)
        if refusals and (len(ctx.variants) == 1 or len(refusals) == len(ctx.variants)):
            raise BenchError(f"mode {mode!r}: " + "; ".join(refusals))
        for why in refusals:
            print(f"appliance bench: mode {mode!r} on one side only: {why}", file=sys.stderr)
    return offers


def _chat_step(ctx: Context, v: Variant, ps: prompt_sets.PromptSet, r: int, mode: str, n_gen: int) -> Step:
    label = f"prompt {ps.name}"
    prompt = ps.prompts[r % len(ps.prompts)]

    def run() -> list[ResultCell]:
        body: dict[str, Any] = {"messages": prompt_sets.with_nonce(list(prompt.messages), nonce()),
                                **_rate_body(n_gen), **_mode_body(v, mode)}
        if prompt.tools:
            body["tools"] = list(prompt.tools)
        cell, _, _ = served_cell(v, CHAT, body, ctx.sampler, mode=mode, prompt_set=ps.name, kind="prompt",
                                 repeat_index=r, extra={"cell": label, "prompt_id": prompt.id})
        return [cell]
    return Step(label, r, v.label, "served", run)


def _mode_body(v: Variant, mode: str) -> dict[str, Any]:
    """The request field that selects the mode on an appliance server ("serial" asks for no
    drafting explicitly there, and sends nothing to another server)."""
    if "speculation" not in ((v.health or {}).get("settings") or {}):
        return {}
    return {"speculate": "off" if mode == "serial" else mode}


def _depth_step(ctx: Context, v: Variant, depth: int, r: int, n_gen: int) -> Step:
    label = f"depth {depth}"
    prose = prompt_sets.load("prose")
    prompt = prose.prompts[r % len(prose.prompts)]

    def run() -> list[ResultCell]:
        base = ctx.prompts.target.count_tokens(json.dumps(list(prompt.messages)))
        messages = prompt_sets.pad_to(list(prompt.messages), ctx.prompts.chars_for(depth - base - 32),
                                      seed=secrets.randbits(32))
        body = {"messages": prompt_sets.with_nonce(messages, nonce()), **_rate_body(n_gen)}
        cell, _, _ = served_cell(v, CHAT, body, ctx.sampler, prompt_set="prose+filler", kind="depth",
                                 repeat_index=r, extra={"cell": label, "target_depth": depth})
        return [cell]
    return Step(label, r, v.label, "served", run)


def _concurrent_step(ctx: Context, v: Variant, label: str, r: int, seqs: Callable[[], list[list[int]]],
                     n_gen: int, pair: dict | None = None) -> Step:
    def run() -> list[ResultCell]:
        prompts = [_prompt(v, ids) for ids in seqs()]
        traces: list[Any] = [None] * len(prompts)
        errors: list[BaseException] = []
        start = threading.Barrier(len(prompts))

        def one(i: int) -> None:
            try:
                start.wait()
                traces[i] = v.target.stream(COMPLETIONS, {"model": v.model_id, "prompt": prompts[i],
                                                          **_rate_body(n_gen)})
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        with ctx.sampler.phase("concurrent") if ctx.sampler is not None else contextlib.nullcontext() as span:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        energy = shared_energy(ctx.sampler, span, len(prompts))
        if errors:
            raise errors[0]
        for t in traces:
            if t.status != 200:
                raise CellFailed(f"HTTP {t.status}: {t.error}")
        agg = aggregate_rate(traces, v.target.count_tokens)
        cells = []
        for i, t in enumerate(traces):
            m = measure(t, v.target.count_tokens, len(seqs()[i]))
            cells.append(to_cell(m, variant=v.label, prompt_set="sweep", kind="concurrency",
                                 concurrency=len(prompts), repeat_index=r,
                                 extra={"cell": label, "stream": i, "aggregate_tps": agg}, **energy))
        texts = [t.text for t in traces]
        return [_with_identity(c, pair, "served", texts) for c in cells]
    return Step(label, r, v.label, "served", run)


# -- needle ----------------------------------------------------------------------------------

NEEDLE_QUESTION = "What is the access code for the archive room? Answer with the code only."


def _needle_step(ctx: Context, v: Variant, length: int) -> Step:
    """A code planted a third of the way into a prompt of about `length` tokens, asked back.
    Past the context the expected answer is a clean HTTP 400, before any stream byte."""
    label = f"needle {length}"
    expected_status = 400 if ctx.n_ctx and length > ctx.n_ctx else 200

    def run() -> list[ResultCell]:
        rng = random.Random()
        code = f"{rng.choice(string.ascii_uppercase)}{rng.choice(string.ascii_uppercase)}-{rng.randrange(1000, 9999)}"
        chars = ctx.prompts.chars_for(max(0, length - 60))
        text = prompt_sets.filler(chars, seed=rng.randrange(1 << 30))
        cut = text.find("\n\n", len(text) // 3)
        cut = cut if cut >= 0 else len(text) // 3
        needle = f"\n\nNote for the reader: the access code for the archive room is {code}.\n\n"
        content = f"[{nonce()}] " + text[:cut] + needle + text[cut:] + "\n\n" + NEEDLE_QUESTION
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0}
        with Phases(ctx.sampler) as phases:
            trace = v.target.stream(CHAT, {"model": v.model_id, **body}, on_first=phases.first_token)
        extra = {"cell": label, "status": trace.status, "expected_status": expected_status,
                 "found": code in trace.text, "code": code, "reply": trace.text[:80]}
        if trace.status != 200 or not trace.chunks:
            return [ResultCell(mode="serial", prompt_set="needle", depth=0, prompt_tokens=0,
                               generated_tokens=0, ttft_ms=0.0, prefill_tps=None, client_decode_tps=None,
                               engine_decode_tps=None, tokens_per_step=None, kind="needle",
                               variant=v.label, extra={**extra, "error": trace.error},
                               energy_note=f"no reply to measure (HTTP {trace.status})")]
        m = measure(trace, v.target.count_tokens)
        return [to_cell(m, variant=v.label, prompt_set="needle", kind="needle", extra=extra, **phases.energy())]
    return Step(label, 0, v.label, "served", run)
