"""A placement as the table `appliance fit` prints and `serve` logs."""
from __future__ import annotations

from .devices import GIB
from .model import ModelFacts
from .planner import Placement


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out) or "none"


def _where_roles(m: ModelFacts, p: Placement) -> list[str]:
    """One line per (role, device): which layers' tensors of that role sit there."""
    lines = []
    for role, label in (("attn", "attention + KV"), ("ffn", "dense FFN"), ("expert", "experts")):
        by_dev: dict[str, set[int]] = {}
        for t in m.tensors:
            if t.role == role and t.layer is not None:
                by_dev.setdefault(p.where[t.name], set()).add(t.layer)
        for dev, layers in sorted(by_dev.items()):
            lines.append(f"  {label:<15} layers {_ranges(sorted(layers))} on {dev}")
    for role, label in (("output", "output"), ("embed", "token embedding")):
        devs = sorted({p.where[t.name] for t in m.tensors if t.role == role})
        if devs:
            lines.append(f"  {label:<15} on {', '.join(devs)}")
    return lines


def render(m: ModelFacts, p: Placement) -> str:
    r = p.request
    slots = f"{r.n_slots} slot{'s' if r.n_slots != 1 else ''} {'sharing' if r.kv_unified else 'x'} {r.n_ctx:,} positions"
    head = (f"{m.name}: {m.arch}, {m.n_layer} layers, {_gib(m.weight_bytes)} GiB of weights"
            f"{f', {m.n_expert} experts ({m.n_expert_used} per token)' if m.n_expert else ''}; "
            f"{slots}, KV {r.kv_type}")
    lines = [head, ("fits" if p.fits else "DOES NOT FIT") + f": n_gpu_layers={p.n_gpu_layers}"
             + (f", experts of the first {p.n_cpu_moe} layers in host memory" if p.n_cpu_moe else "")
             + (f", dense FFNs of the first {p.n_cpu_ffn} layers in host memory" if p.n_cpu_ffn else "")]
    if p.split:
        total = sum(p.split.values())
        lines.append("  layer split: " + ", ".join(f"{g} {x / total:.0%}" for g, x in p.split.items())
                     + (" (--tensor-split)" if r.tensor_split else " (by each device's memory)"))
    lines += _where_roles(m, p)
    cols = ("device", "attn", "ffn", "experts", "output", "embed", "KV", "compute", "total", "budget", "headroom")
    rows = [cols]
    for name, u in p.use.items():
        w = u.weights
        rows.append((name, _gib(w["attn"]), _gib(w["ffn"]), _gib(w["expert"]), _gib(w["output"]), _gib(w["embed"]),
                     _gib(u.kv), _gib(u.compute), _gib(u.total), _gib(u.budget), _gib(u.headroom)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines.append("")
    lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("  (GiB; compute is an estimate of llama.cpp's compute buffers)")
    if p.overrides:
        lines.append("tensor overrides: " + " ".join(f"{pat}={dev}" for pat, dev in p.overrides))
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines) + "\n"
