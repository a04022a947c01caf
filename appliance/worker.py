"""`appliance worker`: this machine's llama.cpp devices served to a head (`appliance serve --rpc`)
over llama.cpp's RPC protocol, as llama.cpp's own rpc-server does (issue 52)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

DEFAULT_PORT = 50052   # llama.cpp's rpc-server's

DESCRIPTION = (
    "Serve this machine's llama.cpp devices (CPU, Vulkan, ROCm, CUDA) to a head started with "
    "`appliance serve --rpc HOST:PORT`, over llama.cpp's RPC protocol: the head places layers on "
    "them. The protocol has NO authentication and no encryption: anyone who reaches the port can "
    "run computations and read or write what the worker holds. Keep it on a private link between "
    "your machines; binding an address other than loopback needs --allow-remote. Needs "
    "llama-cpp-python built with the RPC backend (scripts/rpc_check.sh).")


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="serve this machine's devices to a head over llama.cpp's RPC protocol",
                       description=DESCRIPTION)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--device", action="append", default=[], metavar="NAME",
                   help="a device to offer (CPU, GPU0, Vulkan0, ...; repeatable; default: every GPU, "
                        "else the CPU, as rpc-server chooses)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="keep the tensors a head sends here, so a restarted head does not send "
                        "them again (llama.cpp's rpc-server -c); default: no cache")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="threads for the CPU device (default: half the cores, as rpc-server)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host: the protocol is unauthenticated, use a private link")
    facts = p.add_mutually_exclusive_group()
    facts.add_argument("--facts-port", type=int, metavar="PORT",
                       help="answer GET /hostcheck (this machine's hostcheck facts, which `appliance "
                            "hostcheck --rpc` and bench's stored runs read) on this port (default: the "
                            "next port, PORT + 1, where the head looks: `appliance hostcheck "
                            "--facts-port` asks elsewhere, bench does not). When it cannot be bound "
                            "the worker says so and serves RPC without them, and the head says they "
                            "are unavailable")
    facts.add_argument("--no-facts", action="store_true",
                       help="do not answer GET /hostcheck at all")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .endpoints import Endpoint, is_ipv4, is_loopback
    from .engine.runners import ggml_devices, ggml_rpc

    if not 0 < args.port < 65536:
        return _refuse(f"--port {args.port} is not a port")
    if args.facts_port is not None and not (0 < args.facts_port < 65536 and args.facts_port != args.port):
        return _refuse(f"--facts-port {args.facts_port} is not a port other than --port {args.port}")
    if not is_ipv4(args.host):
        return _refuse(f"--host {args.host}: llama.cpp's RPC server binds a dotted IPv4 address only")
    if not args.allow_remote and not is_loopback(args.host):
        return _refuse(f"--host {args.host} is not a loopback address: the RPC protocol has no "
                       "authentication; pass --allow-remote to bind it on a private link")
    why = ggml_rpc.available()
    if why is not None:
        return _refuse(why)
    try:
        offered = _offered(ggml_devices.devices(), args.device)
    except ValueError as e:
        return _refuse(str(e))
    cache = None
    if args.cache_dir:
        Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = str(Path(args.cache_dir).resolve())
    endpoint = Endpoint(args.host, args.port)
    print(f"appliance worker: serving at {endpoint} (unauthenticated: keep it on a private link), "
          f"tensor cache {cache or 'off'}", flush=True)
    for d in offered:
        print(f"appliance worker: offers {d.name} ({d.description}): {d.total // 2**20} MiB, "
              f"{d.free // 2**20} MiB free", flush=True)
    if not args.no_facts:
        _serve_facts(endpoint, args.facts_port, offered, cache, args.threads)
    # llama.cpp's accept loop never returns to Python: let SIGINT and SIGTERM end the process
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ggml_rpc.start_server(endpoint, [d.index for d in offered], cache, args.threads)
    return _refuse(f"the RPC server at {endpoint} did not start (llama.cpp's reason is above)")


def _serve_facts(endpoint, port: int | None, offered, cache: str | None, threads: int) -> None:
    """This machine's hostcheck facts on `port`, else the next port (worker_facts.py). A port
    that cannot be bound (another program holds it) is said, with what follows, and the worker
    serves RPC without them."""
    from . import worker_facts
    from .engine.runners.ggml_devices import llama_build

    at = worker_facts.facts_endpoint(endpoint, port)
    worker = {"endpoint": str(endpoint), "cache": cache, "threads": threads,
              "offers": [{"name": d.name, "description": d.description, "free": d.free, "total": d.total}
                         for d in offered]}
    try:
        worker_facts.serve(at, worker, llama_build())
    except (OSError, OverflowError) as e:     # in use, or no port after 65535
        print(f"appliance worker: hostcheck facts NOT served at {at}: {getattr(e, 'strerror', None) or e}; "
              f"a head asking there gets another program's answer or none, and says this worker's facts "
              f"are unavailable (--facts-port PORT serves them on a free port)", flush=True)
        return
    elsewhere = "" if at.port == endpoint.port + 1 else \
        f" (not the RPC port + 1, where a head looks: `appliance hostcheck --facts-port {at.port}` asks here)"
    print(f"appliance worker: hostcheck facts at http://{at}{worker_facts.PATH}{elsewhere}", flush=True)


def _offered(devs, names: list[str]):
    """The devices named (by either spelling), else every GPU, else the CPU: rpc-server's choice."""
    from .engine.runners.ggml_devices import find

    if names:
        found = [find(n, devs) for n in names]
        missing = [n for n, d in zip(names, found) if d is None]
        if missing:
            known = ", ".join(f"{d.name} ({d.planner_name})" for d in devs)
            raise ValueError(f"no device {', '.join(missing)}; this build has {known}")
        return found
    gpus = [d for d in devs if d.kind in ("gpu", "igpu")]
    return gpus or [d for d in devs if d.kind == "cpu"][:1]


def _refuse(message: str) -> int:
    print(f"appliance worker: {message}", file=sys.stderr)
    return 2
