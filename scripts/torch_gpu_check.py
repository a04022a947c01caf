"""The torch runner on a GPU against the same on the CPU, for a model and its NVFP4 copy
(`appliance quantize`): prefill and decode rates, teacher-forced agreement with llama.cpp on
the CPU (the independent reference, same file), and the start-up exactness check.

    python3 scripts/torch_gpu_check.py [--model PATH] [--devices cuda,cpu] [--out DIR]

Figures are medians of --repeats, measured in this one run, side by side; the GPU rows use
`--torch-kernels auto` (the Triton kernels where Triton and CUDA are there), with decode steps
as CUDA graphs (`--torch-graphs auto`) and without (`off`), the CPU rows the runner's CPU path.
Nothing here asserts a speed."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.bench.prompt_sets import filler_paragraphs  # noqa: E402
from appliance.config import EngineConfig  # noqa: E402
from appliance.engine.runners import make_runner  # noqa: E402
from appliance.engine.runners.base import Span  # noqa: E402
from appliance.engine.spec.probe import check_exact  # noqa: E402
from appliance.models import embedded_model_path  # noqa: E402
from appliance.quantize import agreement, quantize_file, teacher_forced  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def rates(r, ids: list[int], n_decode: int, device: str, repeats: int) -> tuple[float, float]:
    """(prefill tok/s of the prompt in one chunk, decode tok/s after it), medians."""
    pre, dec = [], []
    for _ in range(repeats):
        r.truncate(0, 0)
        sync(device)
        t0 = time.perf_counter()
        out = r.forward([Span(0, tuple(ids), 0, 1)])[0]
        sync(device)
        t1 = time.perf_counter()
        tok = int(np.argmax(out[-1]))
        for i in range(n_decode):
            tok = int(np.argmax(r.forward([Span(0, (tok,), len(ids) + i, 1)])[0][0]))
        sync(device)
        t2 = time.perf_counter()
        pre.append(len(ids) / (t1 - t0))
        dec.append(n_decode / (t2 - t1))
    return statistics.median(pre), statistics.median(dec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file (default: the embedded model)")
    p.add_argument("--devices", default="cuda,cpu")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="/tmp/torch_gpu_check")
    a = p.parse_args()
    src = Path(a.model) if a.model else embedded_model_path()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    nv = Path(a.out) / (src.stem + ".nvfp4.gguf")
    if not nv.exists():
        quantize_file(src, nv, "nvfp4")
    text = "\n\n".join(filler_paragraphs())
    print(f"{'file':<34} {'device':<6} {'kernels':<7} {'graphs':<8} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'argmax vs llama.cpp':>19} {'KL':>7} {'exact':>5}")
    for path in (src, nv):
        ref_r = make_runner(EngineConfig(n_slots=1, n_ctx=1024), path, "ref")
        ids = ref_r.tokenize(text * 4, add_special=True)
        ref = teacher_forced(ref_r, ids[:300])
        ref_r.close()
        variants = [(d, g) for d in a.devices.split(",") for g in (("auto", "off") if d.startswith("cuda") else ("off",))]
        for device, graphs in variants:
            cfg = EngineConfig(engine="torch", n_slots=1, n_ctx=a.prompt + a.tokens + 64, torch_device=device,
                               torch_graphs=graphs)
            r = make_runner(cfg, path, "check")
            try:
                agree, kl = agreement(ref, teacher_forced(r, ids[:300]))
                exact = check_exact(r, 0, ids[:100], k=8).exact
                pre, dec = rates(r, ids[:a.prompt], a.tokens, device, a.repeats)
                print(f"{path.name[:34]:<34} {device:<6} {r.info.settings.get('kernels', '-'):<7} "
                      f"{r.info.settings.get('graphs', '-'):<8} {pre:>13.0f} "
                      f"{dec:>12.1f} {100 * agree:>18.1f}% {kl:>7.4f} {str(exact):>5}")
            finally:
                r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
