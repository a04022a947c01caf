#!/usr/bin/env python3
"""Issue 72's checks for scripts/vulkan_checks.py: the device's logits against llama.cpp's CPU
backend's (`appliance check` on the model, a corrupted copy refused, serve's start-up check
measured once and remembered by a restart) and fixed-shape decode on the device
(scripts/fixed_shape_ab.py in a child). They use the harness of scripts/vulkan_harness.py;
vulkan_checks.py lists them in its CHECKS and runs them.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vulkan_harness import PY, QUICK, TARGET, Row, Server, env_with


def check_ids_row(name: str, doc: dict, conditions: str, want: str) -> Row:
    c = doc.get("comparison") or {}
    figure = (f"{doc.get('verdict')}: argmax agreement {c.get('argmax_agree', float('nan')):.1%} over "
              f"{c.get('positions')} positions, max |logit diff| {c.get('max_abs_diff', float('nan')):.3g}, KL mean "
              f"{c.get('kl_mean', float('nan')):.3g} max {c.get('kl_max', float('nan')):.3g} nats, perplexity "
              f"{c.get('ppl_device', float('nan')):.4g} device / {c.get('ppl_cpu', float('nan')):.4g} CPU; "
              f"{doc.get('device_s')} s device, {doc.get('cpu_s')} s CPU"
              + (f"; differed: {'; '.join(doc.get('differed') or [])}" if doc.get("differed") else "")
              if c else f"{doc.get('verdict')}: {doc.get('why')}")
    return Row(name, figure, conditions, "ok" if doc.get("verdict") == want else "FAIL")


def check_device(out: Path, ctx: dict) -> list[Row]:
    """`appliance check` on the model (fresh), a corrupted copy on the device against the original
    on the CPU (refused), and serve's start: measured once, remembered by a restart."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from appliance.models import embedded_model_path
    from tests.engine.gguf_fixtures import corrupt_copy

    data = {"XDG_DATA_HOME": tempfile.mkdtemp(prefix="vk-data-")}
    model = Path(TARGET.args[1]) if TARGET.args else embedded_model_path()
    from appliance.fit.gguf_header import read_header

    # the last layer's down projection: on the device with every layer there, near the output (#28211)
    downs = [t.name for t in read_header(model)[1] if t.name.endswith(".ffn_down.weight")]
    last = max(downs, key=lambda n: int(n.split(".")[1]))
    bad = corrupt_copy(model, out / "corrupt.gguf", last)
    rows = []
    for name, args, want in (("device check: appliance check", [str(model)], "agrees"),
                             ("device check: a corrupted tensor on the device", [str(bad), "--reference", str(model)],
                              "differs")):
        t0 = time.monotonic()
        run = subprocess.run([*PY, "check", *args, "--n-gpu-layers", "all", "--json"], capture_output=True,
                             text=True, timeout=1800, env=env_with(data))
        (out / f"check-{want}.txt").write_text(run.stdout + run.stderr)
        doc = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {"verdict": f"exit {run.returncode}",
                                                                                 "why": run.stderr[-300:]}
        rows.append(check_ids_row(name, doc, f"{TARGET.name} on Vulkan0 (all layers) against the CPU backend"
                                  + (f"; the device reads a copy with {last} corrupted" if want == "differs" else "")
                                  + f"; exit {run.returncode} in {time.monotonic() - t0:.0f} s", want))
    for attempt in ("first start", "restart"):
        srv = Server(out, f"devcheck-{attempt.replace(' ', '_')}", [*QUICK, "--n-ctx", "512", "--n-gpu-layers", "all"],
                     data)
        try:
            t0 = time.monotonic()
            health = srv.wait()
            took = time.monotonic() - t0
        finally:
            srv.stop()
        doc = (health or {}).get("settings", {}).get("device_check") or {"verdict": "did not start", "why": srv.tail(300)}
        row = check_ids_row(f"device check at serve's {attempt}", doc, f"{TARGET.name}, --n-gpu-layers all; started in "
                            f"{took:.0f} s; remembered: {doc.get('cached')}", "agrees")
        if attempt == "restart" and not doc.get("cached"):
            row.verdict = "FAIL"
        rows.append(row)
    return rows


def check_fixed_shape(out: Path, ctx: dict) -> list[Row]:
    """Issue 72: fixed-shape decode on Vulkan0 (scripts/fixed_shape_ab.py, in a child): what the
    policy chooses, the fixed shape's step against a plain one, lookup's identity and rate on the
    model, and the MTP fixture's identity with drafts priced free (its head's drafts accepted)."""
    rows = []
    for name, args, what in (("fixed-shape-ab", [*TARGET.args, "--tokens", "24"], f"{TARGET.name}, lookup"),
                             ("fixed-shape-mtp", ["--mtp-fixture", "--tokens", "40"], "the MTP fixture (random)")):
        report = out / f"{name}.json"
        run = subprocess.run([sys.executable, str(Path(__file__).with_name("fixed_shape_ab.py")), *args,
                              "--n-gpu-layers", "all", "--json", str(report)], capture_output=True, text=True,
                             timeout=3600)
        if not report.exists():
            rows.append(Row(f"fixed shape, {what}", run.stderr[-300:], "scripts/fixed_shape_ab.py", "FAIL"))
            continue
        r = json.loads(report.read_text())
        auto, f = r["auto"]["decode_shape"], r.get("forced", {})
        rates = ", ".join(f"{k} {v}" for k, v in f.items() if k.endswith("tok_s"))
        free = f.get("priced_free", {})
        rows.append(Row(f"fixed shape (issue 72), {what}", f"auto: {auto['mode']} ({auto['why']}); forced: identical "
                        f"{sum(f.get('identical', []))}/{len(f.get('identical', []))}; {rates}; drafted / accepted "
                        f"{f.get('drafted')} / {f.get('accepted')}, priced free {free.get('drafted')} / "
                        f"{free.get('accepted')}", f"all layers on Vulkan0, {r['rows']} rows, {r['tokens']} tokens a "
                        "request, one at a time", "ok" if run.returncode == 0 else "FINDING"))
    return rows + [windows_row(out)]


def windows_row(out: Path) -> Row:
    """A fixed-shape verify against its steps inside each KV window of 256, 512 and 1,024 cells
    (exact, or the draft rule Policy.draft_room does not hold here: FAIL) and across its edge
    (what the rule avoids: whether this device's kernels depend on the window)."""
    report = out / "fixed-shape-windows.json"
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("fixed_shape_ab.py")), "--windows",
                          *TARGET.args, "--n-gpu-layers", "all", "--n-ctx", "1100", "--json", str(report)],
                         capture_output=True, text=True, timeout=3600)
    if not report.exists():
        return Row("fixed shape, KV windows", run.stderr[-300:], "scripts/fixed_shape_ab.py --windows", "FAIL")
    found = json.loads(report.read_text())["windows"]
    said = {a: ", ".join(f"{w['window']}: {w['max_abs_diff']:.3g}" for w in found if w["across"] == a)
            for a in (False, True)}
    return Row("fixed shape (issue 72), a verify and its steps' KV windows",
               f"inside a window (max |logit diff|) {said[False]}; across its edge {said[True]}",
               f"{TARGET.name}, all layers on Vulkan0, 5 rows, 4 drafted tokens, the verify's last step on the "
               "window's last cell / one cell further", "ok" if run.returncode == 0 else "FAIL")
