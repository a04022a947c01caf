#!/usr/bin/env python3
"""Fixed-shape decode on llama.cpp (issue 72): what the start-up policy chooses on this device,
whether speculation at the fixed shape gives serial decoding's tokens, and what it is worth.

    python scripts/fixed_shape_ab.py [--model M.gguf | --mtp-fixture] [--n-gpu-layers all] [--rows 5]
                                     [--tokens 64] [--text MESSAGE ...] [--json OUT.json]
    python scripts/fixed_shape_ab.py --step-costs [--model M.gguf] [--repeats 15] [--rounds 3]
    python scripts/fixed_shape_ab.py --windows [--model M.gguf] [--n-ctx 4096] [--json OUT.json]

In-process engines (engine/loop.py), one after another, each on the same requests:

1. `--fixed-shape auto`: what the policy decides here (/health's settings.speculation.decode_shape:
   the fixed shape's exactness, a fixed-shape step's time over a plain step's, chosen or why not).
2. `--fixed-shape off`: plain serial decoding, the rate to beat.
3. `--fixed-shape on` (forced): serial, then lookup (or, with --mtp-fixture, the MTP head) on the
   same requests, then the speculative mode again with drafting and verifying priced as free
   (tests/engine/test_mtp.py's `drafting_free`: at a dear shape the policy may decline to draft,
   and an identity without accepted drafts proves nothing). Identity: both speculative runs'
   tokens equal the fixed-shape serial tokens. The rate: tokens after the first over the engine's
   decode time (`timings.predicted_ms`), per request, of the policy's run.

The requests are a bench prompt set's (tool-calls and editing-code: text the model copies, so
lookup has drafts) and one that repeats itself; greedy, `--tokens` each. With --mtp-fixture the
model is tests/engine/gguf_mtp_fixture.py's tiny glm4moe (random weights, an agreeing head): it
shows identity, not a rate worth quoting; its requests are test_mtp.py's prompts. Prints one line
per engine and a markdown table; exit 1 where an identity failed or no draft was accepted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.bench import prompt_sets  # noqa: E402
from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.loop import EngineLoop  # noqa: E402
from appliance.engine.types import Delta, Done, Error  # noqa: E402
from tests.engine.test_mtp import drafting_free  # noqa: E402
from web import wire  # noqa: E402

REPEAT = ("Repeat this list exactly, then once more:\n"
          + "\n".join(f"- item {i}: path/to/file_{i}.py, value {i * 7 % 11}" for i in range(12)))


def requests(n_ctx: int, tokens: int, mode: str, texts: tuple[str, ...] = ()) -> list:
    """The bench's requests, or with `texts` one user message each (the MTP fixture's: the prompts
    tests/engine/test_mtp.py shows its head's drafts accepted on)."""
    msgs = [[{"role": "user", "content": t}] for t in texts]
    if not texts:
        msgs.append([{"role": "user", "content": REPEAT}])
        for name in ("tool-calls", "editing-code"):
            p = prompt_sets.load(name).prompts[0]
            msgs.append(list(p.messages))
    out = []
    for m in msgs:
        body = {"messages": m, "max_tokens": tokens, "temperature": 0, "speculate": mode, "cache_prompt": False}
        out.append(wire.parse_chat(body, uuid.uuid4().hex, {"m"}, n_ctx).request)
    return out


def run(loop: EngineLoop, reqs: list) -> list[tuple[list[int], Done]]:
    """One request at a time (a rate per request): its tokens and its Done."""
    got = []
    for r in reqs:
        loop.submit(r)
        toks: list[int] = []
        done = None
        while done is None:
            for e in loop.outbox:
                if isinstance(e, Error):
                    raise RuntimeError(e.message)
                if isinstance(e, Delta):
                    toks.extend(e.token_ids)
                elif isinstance(e, Done):
                    done = e
            loop.outbox.clear()
            if done is None:
                loop.scheduler.step()
        got.append((toks, done))
    return got


def rate(results) -> float:
    """Median decode rate: tokens after the first over the engine's decode time."""
    rates = [1000.0 * (len(t) - 1) / d.timings.predicted_ms for t, d in results if d.timings.predicted_ms > 0]
    return statistics.median(rates) if rates else 0.0


def engine(model: str, args, **kw) -> EngineLoop:
    return EngineLoop(EngineConfig(engine="llamacpp", model=model, n_ctx=args.n_ctx, n_slots=1, plan="off",
                                   cache_disk_bytes=0, prompt_cache="off", n_gpu_layers=args.n_gpu_layers,
                                   fixed_shape_rows=args.rows, **kw))


def step_costs(model: str | None, args) -> int:
    """--step-costs: a one-row step plain and at each fixed shape, alternated (spec/shape.py's
    probe, `--repeats` pairs), over `--rounds` rounds, with the load average at each round."""
    import os

    from appliance.engine.runners import make_runner
    from appliance.engine.spec.shape import measure_step_cost
    from appliance.engine.startup import PROBE_TEXT
    from appliance.models import resolve

    ref = resolve(model)
    runner = make_runner(EngineConfig(engine="llamacpp", model=model, n_ctx=args.n_ctx, n_slots=1, plan="off",
                                      n_gpu_layers=args.n_gpu_layers), ref.path, ref.alias)
    ids = runner.tokenize(PROBE_TEXT, add_special=False)[:48]
    print("| round | load (1 min) | rows | plain step ms | fixed step ms | fixed / plain |\n|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for rows in (2, 3, 5, 9):
            c = measure_step_cost(runner, 0, ids, rows, repeats=args.repeats)
            print(f"| {rnd + 1} | {os.getloadavg()[0]:.1f} | {rows} | {c.plain_s * 1e3:.2f} | {c.fixed_s * 1e3:.2f} | "
                  f"{c.overhead:.2f} |", flush=True)
    runner.close()
    return 0


def windows(model: str | None, args) -> int:
    """--windows: at the fixed shape, a verify against its steps (spec/probe.py's check_exact)
    where its last step fills a KV window of 256, 512, 1,024, ... cells to the last cell (the
    nearest a draft comes to a window's edge, Policy.draft_room: must be exact), and where its
    steps' padding crosses into the next window (what the draft rule avoids: shows whether this
    device's kernels depend on the window). Exit 1 where a verify inside a window differs."""
    from appliance.engine.runners import make_runner
    from appliance.engine.spec.probe import check_exact
    from appliance.engine.startup import PROBE_TEXT
    from appliance.models import resolve

    ref, k = resolve(model), args.rows
    runner = make_runner(EngineConfig(engine="llamacpp", model=model, n_ctx=args.n_ctx, n_slots=1, plan="off",
                                      n_gpu_layers=args.n_gpu_layers), ref.path, ref.alias)
    ids = runner.tokenize(PROBE_TEXT, add_special=False)
    ids = (ids * (args.n_ctx // len(ids) + 1))[:args.n_ctx]
    runner.set_decode_rows(k)
    print("| window | prompt | verify and its last step | max \\|logit difference\\| | argmax differs |\n|---|---|---|---|---|")
    ok, w, found = True, runner.kv_window, []
    while w + k <= args.n_ctx:
        for n, across in ((w - 2 * k + 1, False), (w - k, True)):
            t0 = time.perf_counter()
            ex = check_exact(runner, 0, ids[:n], k=k - 1)
            ok &= ex.exact or across
            found.append({"window": w, "prompt": n, "across": across, "max_abs_diff": ex.max_abs_diff,
                          "argmax_differs": ex.argmax_differs, "seconds": round(time.perf_counter() - t0, 1)})
            where = f"{w} / {w + runner.kv_window}" if across else f"both in {w}"
            print(f"| {w} | {n} | {where} | {ex.max_abs_diff:.3g} | {ex.argmax_differs} of {ex.positions} "
                  f"[{found[-1]['seconds']} s] |", flush=True)
        w *= 2
    runner.close()
    _write(args.json, {"rows": k, "n_gpu_layers": args.n_gpu_layers, "windows": found})
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF to serve (default: the embedded model)")
    ap.add_argument("--mtp-fixture", action="store_true", help="the tiny glm4moe with an MTP head (identity only)")
    ap.add_argument("--n-gpu-layers", default="auto")
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--text", action="append", default=[],
                    help="a request's user message instead of the bench's (repeatable): short ones for a slow device")
    ap.add_argument("--n-ctx", type=int, help="default 4096; 2048 for --mtp-fixture, its trained context")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--step-costs", action="store_true", help="only time a step plain and at 2, 3, 5, 9 rows")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", action="store_true", help="only check a verify inside and across KV windows")
    args = ap.parse_args(argv)
    if args.step_costs or args.windows:
        args.n_ctx = args.n_ctx or 4096
        return (windows if args.windows else step_costs)(args.model, args)
    model, mode, texts = args.model, "lookup", tuple(args.text)
    if args.mtp_fixture:
        from tests.engine.gguf_mtp_fixture import write_tiny_mtp
        from tests.engine.test_mtp import PROMPTS
        model, mode, texts = str(Path(tempfile.mkdtemp()) / "tiny-mtp.gguf"), "mtp", PROMPTS
        write_tiny_mtp(model, agree=True)
    if args.n_ctx is None:
        args.n_ctx = 2048 if args.mtp_fixture else 4096
    report: dict = {"model": model or "embedded", "mode": mode, "rows": args.rows, "tokens": args.tokens,
                    "n_gpu_layers": args.n_gpu_layers}

    t0 = time.perf_counter()
    loop = engine(model, args, fixed_shape="auto")
    spec = loop.info.settings["speculation"]
    report["auto"] = {"decode_shape": spec["decode_shape"], "reason": spec["reason"], "default": spec["default"]}
    print(f"auto: {spec['default']} ({spec['reason']}) [{time.perf_counter() - t0:.1f} s]", flush=True)
    loop.close()

    loop = engine(model, args, fixed_shape="off", speculate="off")
    plain = run(loop, requests(args.n_ctx, args.tokens, "off", texts))
    loop.close()
    loop = engine(model, args, fixed_shape="on")
    shape = loop.info.settings["speculation"]["decode_shape"]
    if shape["mode"] != "fixed":
        print(f"the fixed shape was not taken: {shape['why']}")
        report["forced"] = shape
        _write(args.json, report)
        return 1
    serial = run(loop, requests(args.n_ctx, args.tokens, "off", texts))
    drafted = run(loop, requests(args.n_ctx, args.tokens, mode, texts))
    # the policy may decline to draft at a dear shape: identity on accepted drafts needs them priced free
    free = run(drafting_free(loop), requests(args.n_ctx, args.tokens, mode, texts))
    loop.close()
    same = [a[0] == b[0] for a, b in zip(serial, drafted)] + [a[0] == b[0] for a, b in zip(serial, free)]
    report["forced"] = {
        "decode_shape": shape, "identical": same,
        "plain_serial_tok_s": round(rate(plain), 1), "fixed_serial_tok_s": round(rate(serial), 1),
        f"fixed_{mode}_tok_s": round(rate(drafted), 1),
        "tokens_per_step": [round(d.timings.tokens_per_step, 2) for _, d in drafted],
        "drafted": sum(d.timings.draft_n for _, d in drafted),
        "accepted": sum(d.timings.draft_n_accepted for _, d in drafted),
        "serial_equals_plain": [a[0] == b[0] for a, b in zip(plain, serial)],
        "priced_free": {"drafted": sum(d.timings.draft_n for _, d in free),
                        "accepted": sum(d.timings.draft_n_accepted for _, d in free)}}
    f = report["forced"]
    print("| device | policy (auto) | fixed step / plain step | identical | plain serial tok/s | fixed serial | "
          f"fixed {mode} | tokens/step | drafted / accepted | priced free: drafted / accepted | fixed serial = plain serial |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| n_gpu_layers={args.n_gpu_layers} | {report['auto']['decode_shape']['mode']} "
          f"({report['auto']['decode_shape']['why']}) | {shape['overhead']} | {sum(same)}/{len(same)} | "
          f"{f['plain_serial_tok_s']} | {f['fixed_serial_tok_s']} | {f[f'fixed_{mode}_tok_s']} | "
          f"{', '.join(map(str, f['tokens_per_step']))} | {f['drafted']} / {f['accepted']} | "
          f"{f['priced_free']['drafted']} / {f['priced_free']['accepted']} | "
          f"{sum(f['serial_equals_plain'])}/{len(f['serial_equals_plain'])} |")
    _write(args.json, report)
    if not f["priced_free"]["accepted"]:
        print("no draft was accepted even priced free: the identity says nothing about accepted drafts")
    return 0 if all(same) and f["priced_free"]["accepted"] else 1


def _write(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
