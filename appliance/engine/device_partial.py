"""The device check when the whole model's CPU side does not fit: the first and last layers and
the output head (device_slice.py), run as a model of their own on the device and on the CPU.

    the whole model's CPU side fits        device_check.run: the loaded runner against the CPU
    it does not, the slice does            here: the slice loaded on the device (every layer on
                                           it) and on the CPU backend, from a file written to the
                                           cache directory and removed after
    the slice does not fit either          skipped, saying what each needs

The slice's device side is a second, small model on the device, not the loaded runner: it checks
the device's kernels on the same tensor types and bytes (where issue #28211's garbage came from),
and the verdict says which layers it covered.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import gguf

from ..errors import ModelLoadError
from . import device_reference as ref, device_slice
from .device_verdict import MARGIN, DeviceVerdict, Target, check_ids
from .logit_compare import Tolerance, compare, departures
from .runners import ggml_devices
from .runners.base import ModelRunner

# A model of four layers predicts poorly (the embedded model's slice: perplexity 1.8e8), so its
# logits are flatter and rounding moves them more than the whole model's. Measured on this CPU
# (the embedded model's slice, the CPU backend against itself with flash attention on, or with
# flash attention and a q8_0 KV cache): argmax agreement 86-88%, KL mean 0.013-0.020, max
# 0.094-0.129 nats, perplexity x1.06; one tensor zeroed (the last ffn_down, the first attn_q, the
# second ffn_up, the output norm): argmax 0-15%, KL mean 4.3-32 nats, perplexity x2.9-6.6. The
# limits keep the whole model's ~10x room over rounding (docs/gpu.md).
PARTIAL_TOLERANCE = Tolerance(min_argmax_agree=0.60, max_kl_mean=0.2, max_kl=1.5, max_ppl_ratio=1.5)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def partial(runner: ModelRunner, target: Target, paths: tuple[Path, Path], key: tuple[str, str, str], whole: str,
            available: int, work_dir: Path, kw: dict) -> DeviceVerdict:
    """The verdict on the slice. `paths`: the device side's file and the CPU side's (the same, or
    `appliance check --reference`'s known-good copy); `key`: build, driver, the model's sha256;
    `whole`: why the whole model was not compared; `kw`: cpu_logits's settings."""
    build, driver, sha = key
    device = f"{target.name} ({target.description})"

    def skipped(why: str) -> DeviceVerdict:
        return DeviceVerdict("skipped", device, driver, build, sha, why=f"{whole}; {why}: not checked")

    try:
        cut = device_slice.plan(gguf.GGUFReader(paths[0]))
    except (OSError, ValueError, KeyError) as e:
        return skipped(f"the file could not be read for its first and last layers ({e})")
    copies = len(set(paths))
    host = cut.nbytes * (1 + copies if target.host_memory else copies) + MARGIN
    if host > available:
        return skipped(f"{cut.describe()} need about {_gib(host)} of memory, {_gib(available)} are available")
    free = next((d.free for d in ggml_devices.devices() if d.name == target.name), None) \
        if target.handle is not None and not target.host_memory else None
    if free is not None and cut.nbytes + MARGIN > free:
        return skipped(f"{cut.describe()} need about {_gib(cut.nbytes + MARGIN)} on {target.name}, "
                       f"{_gib(free)} are free there")
    work_dir.mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(work_dir).free
    if cut.nbytes * copies > disk:
        return skipped(f"{cut.describe()} need {_gib(cut.nbytes * copies)} of disk in {work_dir}, {_gib(disk)} free")
    files = [work_dir / f"slice-{sha[:16]}-{i}.gguf" for i in range(copies)]
    ids = check_ids(runner)
    try:
        for src, dst in zip(dict.fromkeys(paths), files):
            device_slice.write(src, dst)
        t0 = time.perf_counter()
        dev = ref.file_logits(files[0], ids, target.handle, **kw)
        t1 = time.perf_counter()
        cpu = ref.file_logits(files[-1], ids, None, **kw)
        t2 = time.perf_counter()
    except (ModelLoadError, OSError, ValueError) as e:
        return skipped(f"{cut.describe()} as a model of their own could not run ({getattr(e, 'message', e)})")
    finally:
        for f in files:
            f.unlink(missing_ok=True)
            f.with_name(f.name + ".part").unlink(missing_ok=True)
    c = compare(dev, cpu, ids)
    gone = departures(c, PARTIAL_TOLERANCE)
    return DeviceVerdict("differs" if gone else "agrees", device, driver, build, sha,
                         f"{cut.describe()}, as a {len(cut.keep)}-layer model on {target.name} and on the CPU "
                         f"({whole}), {len(ids)} tokens", c.as_dict(), tuple(gone), PARTIAL_TOLERANCE.as_dict(),
                         round(t1 - t0, 3), round(t2 - t1, 3))
