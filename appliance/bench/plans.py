"""What `sweep` and `bench` measure: each builds a plan of steps (session.Step) over the
variants (one server, or A and B) and the raw reference.

Order inside a repeat alternates what is compared: raw then served on even repeats, served then
raw on odd ones; A then B always (shared/BENCHMARKING.md, rule 7). The same token sequence is
given to raw and served (and to A and B) within a repeat; every repeat draws a fresh nonce.
"""
from __future__ import annotations

import dataclasses
import json
import random
import secrets
import string
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..store import ResultCell
from . import prompt_sets
from .client import BenchError, CellFailed
from .raw import RawReference
from .session import Prompts, Step, Variant, nonce, raw_cells, served_cell, to_cell
from .timing import aggregate_rate, measure

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Context:
    variants: list[Variant]
    raw: RawReference | None
    sampler: Any
    prompts: Prompts

    @property
    def n_ctx(self) -> int:
        known = [v.n_ctx for v in self.variants if v.n_ctx]
        return min(known) if known else 0

    @property
    def n_slots(self) -> int:
        return min(v.n_slots for v in self.variants)


def _once(make: Callable[[], Any]) -> Callable[[], Any]:
    """A value built on first use and shared by the steps of one repeat (the same prompt for
    raw and served, A and B)."""
    box: list[Any] = []

    def get() -> Any:
        if not box:
            box.append(make())
        return box[0]
    return get


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
            ids = _once(lambda p=p: ctx.prompts.ids(p))
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

@dataclass(frozen=True)
class BenchOptions:
    modes: tuple[str, ...] = ("serial",)
    prompt_sets: tuple[str, ...] = prompt_sets.DEFAULT_SETS
    tokens: int = 128
    runs: int = 3
    depths: tuple[int, ...] | None = ()       # empty: half the context; None: no depth rows
    concurrency: tuple[int, ...] = (1, 2, 4)
    concurrency_prompt_tokens: int = 512
    agent_conversations: int = 1
    agent_turns: int = 8
    agent_system_tokens: int = 2000
    agent_turn_tokens: int = 300
    agent_reply_tokens: int = 24
    agent_tool_ms: int = 0                     # the client waits this long before each follow-up (a tool runs)
    agent_restart: bool = False                # restart the server after the replay, then one more turn each
    needle_lengths: tuple[int, ...] | None = None   # None: fractions of the context; () = off


SUPPORTED_MODES = ("serial", "lookup", "draft")


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
            seqs = _once(lambda c=c: [ctx.prompts.ids(o.concurrency_prompt_tokens) for _ in range(c)])
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
        phase = ctx.sampler.phase("concurrent") if ctx.sampler is not None else None
        if phase is not None:
            phase.__enter__()
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            if phase is not None:
                phase.__exit__(None, None, None)
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
                                 extra={"cell": label, "stream": i, "aggregate_tps": agg}))
        texts = [t.text for t in traces]
        return [_with_identity(c, pair, "served", texts) for c in cells]
    return Step(label, r, v.label, "served", run)


# -- agent replay ------------------------------------------------------------------------------

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. Work in small steps: read the files "
    "you need with read_file, search with search_code, run the tests with run_shell, and change "
    "files with write_file. After each tool result, say in one sentence what you learned and call "
    "the next tool. Never guess a file's contents; read it first.\n\n"
    "Project notes follow.\n\n")


class Agent:
    """One replayed agent conversation: a long system prompt with tools, then turns that each
    append a tool call and its result of a few hundred tokens and resend everything."""

    def __init__(self, ctx: Context, o: BenchOptions, index: int, tools: Sequence[dict]) -> None:
        rng = random.Random(1000 + index)
        notes = prompt_sets.filler(ctx.prompts.chars_for(o.agent_system_tokens), seed=rng.randrange(1 << 30))
        self.tools = list(tools)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"[{nonce()}] " + AGENT_SYSTEM + notes},
            {"role": "user", "content": "The test suite fails in the storage module. Find out why and fix it."}]
        self.index, self.o, self.ctx, self.rng = index, o, ctx, rng

    def add_turn(self, turn: int) -> None:
        call_id = f"call_{self.index}_{turn}"
        path = f"src/storage/part_{turn}.py"
        # content "" rather than none: templates that print message.content (SmolLM2's, rendered
        # by llama-cpp-python's server) need the field
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]})
        body = prompt_sets.filler(self.ctx.prompts.chars_for(self.o.agent_turn_tokens),
                                  seed=self.rng.randrange(1 << 30))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": f"# {path}\n{body}"})

    def body(self, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        # a fixed amount of decode per turn (the reply is replaced by the next tool call anyway)
        return {"messages": messages or self.messages, "tools": self.tools,
                "max_tokens": self.o.agent_reply_tokens, "temperature": 0, "ignore_eos": True}


def agent_steps(ctx: Context, v: Variant, o: BenchOptions) -> list[Step]:
    """Conversations interleaved turn by turn, then a cold request at the first follow-up's and
    the last turn's depth (the same conversation behind a fresh nonce) to compare against."""
    if o.agent_conversations < 1 or o.agent_turns < 1:
        return []
    tools = next(p.tools for p in prompt_sets.load("tool-calls").prompts if p.tools)
    agents = _once(lambda: [Agent(ctx, o, i, tools) for i in range(o.agent_conversations)])
    steps = []
    for turn in range(o.agent_turns):
        for c in range(o.agent_conversations):
            def run(c: int = c, turn: int = turn) -> list[ResultCell]:
                agent = agents()[c]
                extra = {"cell": "agent", "conversation": c, "turn": turn}
                if turn > 0:
                    agent.add_turn(turn)
                    if o.agent_tool_ms:   # the tool's run time: the server is idle meanwhile
                        time.sleep(o.agent_tool_ms / 1000)
                        extra["tool_ms"] = o.agent_tool_ms
                cell, _, _ = served_cell(v, CHAT, agent.body(), ctx.sampler, prompt_set="agent", kind="agent",
                                         cache_on=True, extra=extra)
                return [cell]
            steps.append(Step(f"agent c{c} turn {turn}", 0, v.label, "served", run))
    if o.agent_restart:
        steps += _restart_steps(ctx, v, o, agents)
    for turn in sorted({min(1, o.agent_turns - 1), o.agent_turns - 1}):
        def cold(turn: int = turn) -> list[ResultCell]:
            agent = agents()[0]
            # the conversation as it stood at that turn, behind a new nonce: nothing of it is cached
            upto = 2 + 2 * turn
            messages = [dict(m) for m in agent.messages[:upto]]
            messages[0]["content"] = f"[{nonce()}] " + messages[0]["content"]
            cell, _, _ = served_cell(v, CHAT, agent.body(messages), ctx.sampler, prompt_set="agent",
                                     kind="agent-cold", extra={"cell": f"agent cold turn {turn}", "turn": turn})
            return [cell]
        steps.append(Step(f"agent cold turn {turn}", 0, v.label, "served", cold))
    return steps


def _restart_steps(ctx: Context, v: Variant, o: BenchOptions, agents: Callable[[], list[Agent]]) -> list[Step]:
    """Restart the server (its prompt states go to disk at SIGTERM), then each conversation's
    next turn: what a saved conversation costs after a restart."""
    def restart() -> list[ResultCell]:
        if v.target.server is not None:
            v.target.server.restart()
        elif v.target.restart_command:
            v.target.restart_with(v.target.restart_command)
        else:
            raise CellFailed("--agent-restart against a server the bench did not start needs its restart "
                             "command (--restart-command for --url, --against-restart-command for --against)")
        return []
    steps = [Step("agent restart", 0, v.label, "served", restart)]
    turn = o.agent_turns
    for c in range(o.agent_conversations):
        def run(c: int = c) -> list[ResultCell]:
            agent = agents()[c]
            agent.add_turn(turn)
            cell, _, _ = served_cell(v, CHAT, agent.body(), ctx.sampler, prompt_set="agent", kind="agent-restart",
                                     cache_on=True, extra={"cell": "agent after restart", "conversation": c,
                                                           "turn": turn})
            return [cell]
        steps.append(Step(f"agent c{c} turn {turn} after restart", 0, v.label, "served", run))
    return steps


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
        trace = v.target.stream(CHAT, {"model": v.model_id, **body})
        extra = {"cell": label, "status": trace.status, "expected_status": expected_status,
                 "found": code in trace.text, "code": code, "reply": trace.text[:80]}
        if trace.status != 200 or not trace.chunks:
            return [ResultCell(mode="serial", prompt_set="needle", depth=0, prompt_tokens=0,
                               generated_tokens=0, ttft_ms=0.0, prefill_tps=None, client_decode_tps=None,
                               engine_decode_tps=None, tokens_per_step=None, kind="needle",
                               variant=v.label, extra={**extra, "error": trace.error})]
        m = measure(trace, v.target.count_tokens)
        return [to_cell(m, variant=v.label, prompt_set="needle", kind="needle", extra=extra)]
    return Step(label, 0, v.label, "served", run)
