"""The raw reference's timed loop, one for both workers: llama.cpp's (`raw._Llama`) and the torch
runner's (`raw_torch.TorchWorker`)."""
from __future__ import annotations

import time
from typing import Any


def timed_run(w: Any, seqs: list[list[int]], n_gen: int) -> tuple[list[float], float, float, list[list[int]]]:
    """Each sequence prefilled alone by `w.prefill` (its TTFT), then all decoded together by
    `w.step` for n_gen - 1 steps: (ttft_ms per sequence, rate per stream, aggregate rate, tokens
    per sequence). The llama.cpp worker's and the torch runner's (raw_torch.py) alike."""
    ttft, out = [], []
    for s, toks in enumerate(seqs):
        t0 = time.perf_counter()
        out.append([w.prefill(s, toks)])
        ttft.append(1000.0 * (time.perf_counter() - t0))
    pos = [len(t) for t in seqs]
    t0 = time.perf_counter()
    for _ in range(n_gen - 1):
        for s, tok in enumerate(w.step([(out[s][-1], pos[s], s) for s in range(len(seqs))])):
            out[s].append(tok)
            pos[s] += 1
    dt = time.perf_counter() - t0
    rate = (n_gen - 1) / dt if dt > 0 else 0.0
    return ttft, rate, rate * len(seqs), out


def speculative_run(w: Any, seqs: list[list[int]], n_gen: int) -> tuple[list[float], float, float, list[list[int]], dict]:
    """As `timed_run`, decoding with the speculation `serve --speculate auto` would run on this
    runner: the start-up probes first (engine/startup.verify_probes: is a verify exact here, what
    does a forward of m rows cost; once per worker), then, where the verify is exact, prompt
    lookup drafts chosen by the server's own arithmetic (spec.Speculator) and verified greedily,
    several tokens committed per forward. Where it is not exact the run is serial, as the
    server's would be. The fifth value says which: {"mode", "reason", "steps" (forwards),
    "tokens" (decoded per stream after the prefill's), "proposed", "accepted"}. The tokens equal
    timed_run's (greedy, and a verify equals single steps where it drafts)."""
    policy = _policy(w)
    if not policy.allowed:
        return (*timed_run(w, seqs, n_gen), {"mode": "off", "reason": policy.reason, "steps": n_gen - 1,
                                             "tokens": n_gen - 1, "proposed": 0, "accepted": 0})
    from ..engine.spec import Speculator

    spec = Speculator(policy)
    ttft, out = [], []
    for s, toks in enumerate(seqs):
        t0 = time.perf_counter()
        out.append([w.prefill(s, toks)])
        ttft.append(1000.0 * (time.perf_counter() - t0))
    states = [spec.start(list(toks) + o, "lookup") for toks, o in zip(seqs, out)]
    t0, steps = time.perf_counter(), 0
    while min(len(o) for o in out) < n_gen:
        live = [s for s in range(len(seqs)) if len(out[s]) < n_gen]
        drafts = spec.propose([states[s] for s in live], [n_gen - len(out[s]) - 1 for s in live], live,
                              [len(seqs[s]) + len(out[s]) - 1 for s in live])
        rows = _verify(w, [(s, (out[s][-1], *d), len(seqs[s]) + len(out[s]) - 1) for s, d in zip(live, drafts)])
        for s, d, got in zip(live, drafts, rows):
            n = next((i for i in range(len(d)) if got[i] != d[i]), len(d))   # drafts the target agreed with
            new = got[:n + 1][:n_gen - len(out[s])]
            spec.verified(states[s], len(new), new)
            out[s] += new
            states[s].index.extend(new)
            w.truncate(s, len(seqs[s]) + len(out[s]) - 1)   # the rejected drafts' KV
        steps += 1
    dt = time.perf_counter() - t0
    rate = (n_gen - 1) / dt if dt > 0 else 0.0
    c = spec.stats()
    return ttft, rate, rate * len(seqs), out, {"mode": "lookup", "reason": policy.reason, "steps": steps,
                                               "tokens": n_gen - 1, "proposed": c.draft_proposed,
                                               "accepted": c.draft_accepted}


def _verify(w: Any, entries: list[tuple[int, tuple[int, ...], int]]) -> list[list[int]]:
    """(sequence, tokens, first position) each, in one forward of the worker's runner: the
    greedy next token (lowest id on ties) after every row."""
    import numpy as np

    from ..engine.runners.base import Span

    got = w.forward([Span(seq, toks, pos, len(toks)) for seq, toks, pos in entries])
    return [[int(i) for i in np.asarray(g).argmax(-1)] for g in got]


def _policy(w: Any) -> Any:
    """The speculation policy `serve --speculate auto` would decide on this worker's runner
    (prompt lookup: a raw worker has no draft model or MTP head), measured once."""
    if getattr(w, "spec_policy", None) is None:
        from ..engine.probe_memo import ProbeMemo
        from ..engine.spec import decide
        from ..engine.startup import PROBE_TEXT, verify_probes

        exactness, cost, _ = verify_probes(w, w.tokenize(PROBE_TEXT), ProbeMemo(None, w))
        w.spec_policy = decide("auto", False, exactness, cost)
    return w.spec_policy
