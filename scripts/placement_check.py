#!/usr/bin/env python3
"""The fit planner's bytes per device against what llama.cpp allocated, for one model load.

Loads a GGUF through the llama.cpp runner with the serve flags given (placement chosen by the
planner, as `serve` does), catches llama.cpp's own log lines that state each buffer's size
(`<dev> model buffer size`, `<dev> KV buffer size`, `<dev> compute buffer size`), and prints
them beside the planner's weights, KV and compute estimate for the same device. Runs on any
build: on a CPU build every buffer is the CPU's; on a GPU build (scripts/gpu_check.sh) the
GPU's too.

    python scripts/placement_check.py [--model X.gguf] [--n-ctx 8192] [--n-slots 4] [serve flags...]
"""
from __future__ import annotations

import argparse
import logging
import re
import sys

MIB = 2**20
BUFFER = re.compile(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB")


def main(argv: list[str] | None = None) -> int:
    from appliance import config, flags
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from appliance.models import resolve

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_arguments(ap, config.EngineConfig)
    args = ap.parse_args(argv)
    cfg = config.load({**vars(args), "plan": "off"}).engine
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("appliance.llamacpp")
    log.setLevel(logging.INFO)
    log.addHandler(Catch())
    ref = resolve(cfg.model, cfg.model_alias)
    runner = LlamaCppRunner(cfg, ref.path, ref.alias)
    got: dict[tuple[str, str], float] = {}
    for line in lines:
        for dev, kind, mib in BUFFER.findall(line):
            dev = "CPU" if dev.upper().startswith("CPU") else dev
            got[(dev, kind)] = got.get((dev, kind), 0.0) + float(mib)
    p = runner.info.placement
    print(f"{ref.path.name}: n_gpu_layers={p['n_gpu_layers']}, kv {p['kv_type']}, {p['n_slots']} x {p['n_ctx']}")
    print(f"{'device':<10} {'what':<8} {'planned MiB':>12} {'llama.cpp MiB':>14} {'ratio':>7}")
    names = {d["name"]: ("CPU" if d["kind"] == "cpu" else "GPU0") for d in p["llama_devices"]}
    for (dev, kind), mib in sorted(got.items()):
        use = p["devices"].get(names.get(dev, dev)) or {}
        planned = {"model": sum((use.get("weights") or {}).values()), "KV": use.get("kv", 0),
                   "compute": use.get("compute", 0)}[kind] / MIB
        ratio = f"{mib / planned:.3f}" if planned else "-"
        print(f"{dev:<10} {kind:<8} {planned:>12.1f} {mib:>14.1f} {ratio:>7}")
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
