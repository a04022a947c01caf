"""`appliance fit`: where a model's tensors would go on this host (or another), without loading it."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from ..rope import DEFAULT_N_CTX, KINDS, check_flags, served
from . import overrides
from .devices import Device, from_snapshot, main_gpu_only, with_workers
from .model import ModelFacts, from_gguf
from .planner import KV_TYPES, FitRequest, plan, split_of
from .render import render
from .shapes import SHAPES, build

DESCRIPTION = (
    "Plan where a model's layers, tensors and KV cache go on this host's devices (or on another "
    "host's, from its `appliance hostcheck --json`), from the GGUF's tensor table and the devices' "
    "memory, without loading a weight. Prints the placement and the bytes per device; when it does "
    "not fit, what would (a smaller KV type, fewer slots, a shorter context). Exit status 0 when it "
    "fits, 1 when it does not, 2 on bad input.")


def add_parser(sub) -> None:
    p = sub.add_parser("fit", help="plan a model's placement on the GPU and CPU without loading it",
                       description=DESCRIPTION)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", metavar="PATH", help="a GGUF file (default: the embedded model)")
    what.add_argument("--shape", choices=sorted(SHAPES), help="a well-known model by its published shape")
    p.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX, help="positions per slot, 0 = the trained context "
                   f"(default {DEFAULT_N_CTX}, at most the trained context without --rope-scaling)")
    p.add_argument("--rope-scaling", choices=KINDS, help="RoPE scaling, as serve's (default: the GGUF's): "
                   "a --n-ctx past the trained context needs linear or yarn")
    p.add_argument("--rope-scale", type=float, metavar="N", help="RoPE context factor, as serve's (default: the "
                   "GGUF's, else --n-ctx / the original context)")
    p.add_argument("--yarn-orig-ctx", type=int, metavar="N", help="YaRN's original context, as serve's")
    p.add_argument("--n-slots", type=int, default=4, help="sequences decoded together (default 4)")
    p.add_argument("--kv-type", choices=KV_TYPES, default="f16", help="K and V cache type (default f16)")
    p.add_argument("--kv-unified", action="store_true", help="one KV pool of --n-ctx positions the slots share, as serve's")
    p.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp micro-batch (default 512)")
    p.add_argument("--flash-attn", action="store_true",
                   help="llama.cpp's flash attention (no attention scores in the compute buffer; on with a "
                        "quantised --kv-type)")
    p.add_argument("--n-gpu-layers", default="auto", metavar="N|auto|all",
                   help="layers on the GPU (default auto: the most that fit)")
    p.add_argument("--cpu-moe", action="store_true", help="every routed expert in host memory")
    p.add_argument("--n-cpu-moe", type=int, metavar="N", help="the experts of the first N layers in host memory")
    p.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="REGEX=DEVICE",
                   help="put tensors whose name matches REGEX on DEVICE (CPU, GPU0, ...); repeatable, "
                        "the first match wins (llama-server's -ot)")
    p.add_argument("--host", metavar="SNAPSHOT.json",
                   help="plan for the host of this `appliance hostcheck --json` (default: this host)")
    p.add_argument("--rpc", metavar="HOST:PORT[,...]",
                   help="plan with these `appliance worker`s' devices as GPU0, GPU1, ... (this host's GPUs after "
                        "them), their memory asked over llama.cpp's RPC protocol, layers split over them as "
                        "`serve --rpc` splits them (needs the RPC build)")
    p.add_argument("--tensor-split", metavar="N,N,...",
                   help="the GPUs' shares of the layers, as serve's (default: by each GPU's memory; without it "
                        "and --rpc, the first GPU holds the layers, as serve's --main-gpu 0)")
    p.add_argument("--json", action="store_true", help="print the placement as JSON")
    p.set_defaults(func=run)


class BadInput(ValueError):
    pass


def _request(args: argparse.Namespace, m: ModelFacts, devices: list[Device]) -> FitRequest:
    if args.n_ctx < 1 or args.n_slots < 1 or args.n_ubatch < 1:
        raise BadInput("--n-ctx, --n-slots and --n-ubatch must be at least 1")
    ngl = {"auto": None, "all": m.n_layer + 1}.get(args.n_gpu_layers)
    if ngl is None and args.n_gpu_layers != "auto":
        try:
            ngl = int(args.n_gpu_layers)
        except ValueError:
            raise BadInput(f"--n-gpu-layers must be a number, auto or all, not {args.n_gpu_layers!r}") from None
        if ngl < 0:
            raise BadInput("--n-gpu-layers must not be negative")
    if args.cpu_moe and args.n_cpu_moe is not None:
        raise BadInput("give --cpu-moe or --n-cpu-moe, not both")
    n_cpu_moe = m.n_layer if args.cpu_moe else args.n_cpu_moe
    if n_cpu_moe is not None and not 0 <= n_cpu_moe:
        raise BadInput("--n-cpu-moe must not be negative")
    req = FitRequest(n_ctx=args.n_ctx, n_slots=args.n_slots, kv_type=args.kv_type, n_ubatch=args.n_ubatch,
                     flash_attn=args.flash_attn or args.kv_type != "f16",
                     n_gpu_layers=ngl, n_cpu_moe=None if n_cpu_moe is None else min(n_cpu_moe, m.n_layer),
                     overrides=parse_overrides(args.override_tensor, devices),
                     tensor_split=_split(args.tensor_split) if args.tensor_split else (), kv_unified=args.kv_unified)
    try:
        split_of(req, devices)
    except ValueError as e:
        raise BadInput(str(e)) from None
    return req


def _split(text: str) -> tuple[float, ...]:
    from ..endpoints import parse_split

    try:
        return parse_split(text)
    except ValueError as e:
        raise BadInput(str(e)) from None


def context(args: argparse.Namespace, m: ModelFacts) -> tuple[int, str]:
    """(positions per slot, how) `m` is served at with --n-ctx and the RoPE flags: serve's rules
    (`appliance/rope.py`: 0 the trained context, the default at most the trained context)."""
    flags = SimpleNamespace(n_ctx=args.n_ctx, rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                            yarn_orig_ctx=args.yarn_orig_ctx, rope_freq_scale=None, rope_freq_base=None,
                            yarn_ext_factor=None, yarn_attn_factor=None, yarn_beta_fast=None, yarn_beta_slow=None)
    try:
        if args.n_ctx < 0:
            raise ValueError("--n-ctx must be 0 (the trained context) or positive")
        check_flags(flags)
        n_ctx, r = served(flags, m.positions)
    except ValueError as e:
        raise BadInput(str(e)) from None
    return n_ctx, r.describe(n_ctx, m.n_ctx_train)


def parse_overrides(items: list[str], devices: list[Device]) -> tuple[tuple[str, str], ...]:
    """REGEX=DEVICE pairs, checked: the pattern compiles and the device exists on the host."""
    try:
        pairs = overrides.parse_overrides(items)
    except ValueError as e:
        raise BadInput(str(e)) from None
    names = {d.name for d in devices}
    for pattern, device in pairs:
        if device not in names:
            raise BadInput(f"--override-tensor '{pattern}={device}': no device {device!r} on this host "
                           f"(it has {', '.join(sorted(names))})")
    return pairs


def host_devices(path: str | None) -> list[Device]:
    if path is None:
        from hostcheck import collect, to_jsonable

        snap = {"snapshot": collect(power_interval_s=0.0).to_dict()}
        llama = _local_llama()
        if llama is not None:      # what hostcheck --json holds: a GPU only llama.cpp sees is planned too
            snap["llama_cpp"] = to_jsonable(llama)
        return from_snapshot(snap)
    try:
        return from_snapshot(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError) as e:
        raise BadInput(f"--host {path}: not a hostcheck snapshot it can read: {e}") from None


def _workers(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """Register the workers' devices in llama.cpp's registry, as serve does before it places, and
    say what each offers: (its address, free, total)."""
    from ..endpoints import parse_endpoints

    if args.host is not None:
        raise BadInput("--rpc plans for this host: give it without --host")
    try:
        from ..engine.runners import ggml_devices, ggml_rpc

        ggml_rpc.add_servers(parse_endpoints(args.rpc))
        return [(d.description, d.free, d.total) for d in ggml_devices.devices() if d.remote]
    except (ValueError, RuntimeError) as e:     # a bad address, no RPC build, no answer
        raise BadInput(str(e)) from None


def _local_llama():
    """The installed llama.cpp's devices (hostcheck.advice.LlamaBuild), or None without one."""
    try:
        from ..engine.runners.ggml_devices import llama_build

        return llama_build()
    except (ImportError, OSError, AttributeError):
        return None


def _model(args: argparse.Namespace) -> ModelFacts:
    if args.shape:
        return build(args.shape)
    if args.model is None:
        from ..models import embedded_model_path

        return from_gguf(embedded_model_path())
    try:
        return from_gguf(args.model)
    except (OSError, ValueError, KeyError) as e:
        raise BadInput(f"--model {args.model}: not a GGUF it can read: {e}") from None


def _check_cost(m: ModelFacts, p) -> tuple[float, int, int, str] | None:
    """(seconds, tokens, cores, what) of the device check's CPU side where a GPU holds layers, on
    this host's physical cores (check_cost.py): the whole model, or where its CPU side (what the
    GPUs hold and 64 MiB) would not fit in the host's headroom, its first and last layers; None
    with no layer on a GPU."""
    import psutil

    from .check_cost import CHECK_TOKENS, check_seconds, slice_layers

    if p.n_gpu_layers <= 0:
        return None
    cores = psutil.cpu_count(logical=False) or 1
    cpu = p.use.get("CPU")
    whole = sum(sum(u.weights.values()) for name, u in p.use.items() if name != "CPU") + 64 * 2**20
    if cpu is not None and whole > cpu.headroom:
        layers = slice_layers(m)
        return (round(check_seconds(m, cores, layers=layers), 1), CHECK_TOKENS, cores,
                f"layers {', '.join(map(str, sorted(layers)))} and the output head: the whole model's CPU side, "
                f"{whole / 2**30:.1f} GiB, would not fit beside the plan")
    return round(check_seconds(m, cores), 1), CHECK_TOKENS, cores, "the whole model"


def run(args: argparse.Namespace) -> int:
    try:
        m = _model(args)
        workers = _workers(args) if args.rpc else []
        devices = host_devices(args.host)
        devices = with_workers(devices, workers) if args.rpc or args.tensor_split else main_gpu_only(devices)
        args.n_ctx, how = context(args, m)
        req = _request(args, m, devices)
    except BadInput as e:
        print(f"appliance fit: {e}", file=sys.stderr)
        return 2
    p = plan(m, req, devices)
    cost = _check_cost(m, p)
    if args.json:
        print(json.dumps({"model": m.name, "weight_bytes": m.weight_bytes, "context": how, **p.to_dict(),
                          "device_check_s": cost[0] if cost else None,
                          "device_check_covers": cost[3] if cost else None}, indent=2))
    else:
        print(render(m, p) + f"context: {how}\n" + (f"device check at its first start: about {cost[0]:.0f} s "
                                                      f"of CPU ({cost[1]} tokens on {cost[2]} cores; {cost[3]})\n"
                                                      if cost else ""), end="")
    return 0 if p.fits else 1
