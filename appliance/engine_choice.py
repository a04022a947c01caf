"""`--engine auto`: the engine a model is served on, chosen by measurement.

`appliance tune --engines llamacpp,torch` times the torch runner beside llama.cpp's candidates
(the same raw workers, alternated in every repeat; `bench/raw_torch.py`) and scores each at every
measured depth as tune scores llama.cpp's settings (`tune_score`: one prompt chunk at the
prefill rate plus 128 tokens at the decode rate). Against llama.cpp's winner at each depth, the
engine with the lower total over the depths is written into the plan's "engines" section for the
model; the torch runner must beat llama.cpp by more than NEAR_TIE, else llama.cpp (the reference
engine, and the one that serves every model) keeps it.

At start, `resolve` turns `auto` into an engine: the plan's choice for this model file (the plan
used whole or not at all, as for llama.cpp's settings), else llama.cpp with the reason. A choice of
the torch runner falls back to llama.cpp where it cannot serve: torch not installed, a setting
only llama.cpp has (--kv-type, --mmproj, --lora, tensor placement), or a load it refuses (an
architecture it does not run; startup.py). /health's settings.engine_choice says which and why.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from .tune_score import NEAR_TIE, medians_of

ENGINES = ("llamacpp", "torch")


@dataclass(frozen=True)
class EngineChoice:
    engine: str            # llamacpp | torch
    by: str                # plan | default | fallback
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "by": self.by, "reason": self.reason}


def choose_engine(scores: Mapping[str, Mapping[int, float]]) -> tuple[str, str]:
    """(engine, why) from each engine's score in seconds at each depth (llama.cpp's: its tuned
    winner's); the torch runner wins only by more than NEAR_TIE over the depths both measured."""
    depths = sorted(set(scores.get("llamacpp", {})) & set(scores.get("torch", {})))
    if not depths:
        return "llamacpp", "the torch runner was not measured"
    total = {e: sum(scores[e][d] for d in depths) for e in ENGINES}
    ratio = total["torch"] / total["llamacpp"]
    where = f"over depths {', '.join(f'{d:,}' for d in depths)}"
    if ratio < 1 - NEAR_TIE:
        return "torch", f"the torch runner's score is {ratio:.2f}x llama.cpp's {where}"
    return "llamacpp", (f"the torch runner's score is {ratio:.2f}x llama.cpp's {where} (it must be under "
                        f"{1 - NEAR_TIE:.2f}x to be chosen)")


def as_served(runs: Sequence[tuple[Any, Mapping]], candidate: int, depth: int) -> dict | None:
    """One engine's medians at a depth from tune's runs with speculation as serve runs it
    (tune._measure_speculation: (Measurement, raw_run.speculative_run's account) each), with
    what the speculation did: its mode, drafted tokens accepted, tokens committed per forward;
    None if not measured."""
    mine = [(m, a) for m, a in runs if m.candidate == candidate and m.depth == depth]
    medians = medians_of([m for m, _ in mine], candidate, depth)
    if medians is None:
        return None
    proposed, accepted = sum(a.get("proposed", 0) for _, a in mine), sum(a.get("accepted", 0) for _, a in mine)
    steps, tokens = sum(a.get("steps", 0) for _, a in mine), sum(a.get("tokens", 0) for _, a in mine)
    modes = sorted({a.get("mode", "off") for _, a in mine})
    return {**medians, "speculation": {"mode": "/".join(modes), "reason": mine[0][1].get("reason", ""),
                                       "proposed": proposed, "accepted": accepted,
                                       "tokens_per_step": round(tokens / steps, 3) if steps else 1.0}}


def render(model: str, rows: list[tuple[int, str, dict]], chosen: str, why: str) -> str:
    """The engine table tune prints: depth, engine, its medians and score, with the speculation
    each ran (as `serve --speculate auto` would: lookup where its verify is exact, else off)."""
    lines = [f"## Engine for {model}: {chosen}", "", why, "",
             "each engine decoding with the speculation serve runs on it (--speculate auto)", "",
             "| depth | engine | speculation | accepted | tokens/step | prefill tok/s | decode tok/s | score s |",
             "|---|---|---|---|---|---|---|---|"]
    for d, engine, m in rows:
        sp = m.get("speculation") or {}
        acc = f"{sp['accepted']}/{sp['proposed']}" if sp.get("proposed") else "-"
        lines.append(f"| {d:,} | {engine} | {sp.get('mode', 'off')} | {acc} | {sp.get('tokens_per_step', 1.0):.2f} | "
                     f"{m['prefill_tps']:,.1f} | {m['decode_tps']:,.1f} | {m['score_s']:.3f} |")
    return "\n".join(lines) + "\n"


def _torch_blocked(cfg: Any) -> str | None:
    """Why the torch runner cannot serve with these settings, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if cfg.kv_type != "f16":
        return f"--kv-type {cfg.kv_type} is llama.cpp's"
    if cfg.mmproj is not None:
        return "--mmproj (images) is served by llama.cpp"
    if cfg.lora_files():
        return "--lora (LoRA adapters) is applied by llama.cpp"
    if cfg.override_tensor or cfg.cpu_moe or cfg.n_cpu_moe is not None:
        return "tensor placement (--override-tensor, --cpu-moe) is llama.cpp's"
    return None


def resolve(cfg: Any, model_path: Path) -> tuple[Any, EngineChoice | None]:
    """cfg with `auto` turned into an engine, and the choice (None when --engine named one)."""
    if cfg.engine != "auto":
        return cfg, None
    if Path(model_path).is_dir():      # a Hugging Face checkpoint: the torch runner reads those
        choice = EngineChoice("torch", "default", "a checkpoint directory is served by the torch runner")
    else:
        choice = _from_plan(cfg, model_path)
        if choice.engine == "torch" and (blocked := _torch_blocked(cfg)):
            choice = EngineChoice("llamacpp", "fallback", f"the plan chose the torch runner, but {blocked}")
    return replace(cfg, engine=choice.engine), choice


def _from_plan(cfg: Any, model_path: Path) -> EngineChoice:
    from .engine import plan as plan_mod
    from .models import file_fingerprint

    path, _ = cfg.resolved_plan()
    none = "run `appliance tune --engines llamacpp,torch` to measure both"
    if path is None or not Path(path).exists():
        return EngineChoice("llamacpp", "default", f"no tuned plan ({none})")
    try:
        plan = plan_mod.load(path, plan_mod.current_fingerprint(plan_mod.llama_cpp_build()))
    except plan_mod.PlanRefused as e:
        return EngineChoice("llamacpp", "default", f"the tuned plan is not this machine's ({e})")
    entry = (plan.engines or {}).get(file_fingerprint(model_path))
    if entry is None:
        return EngineChoice("llamacpp", "default", f"the plan {path} did not measure the engines on this model ({none})")
    return EngineChoice(entry["engine"], "plan", f"{path}: {entry.get('why', 'measured by appliance tune')}")


def fallback(cfg: Any, choice: EngineChoice, error: str) -> tuple[Any, EngineChoice]:
    """After the torch runner the plan chose refused the model: llama.cpp, saying why."""
    return replace(cfg, engine="llamacpp"), EngineChoice(
        "llamacpp", "fallback", f"the plan chose the torch runner, which could not load the model: {error}")


def thread_wait(cfg: Any, model_path: Path) -> tuple[str, str]:
    """(spin or passive, why) for `--thread-wait auto`: the tuned plan's choice for this model
    file (`tune` measured passive against spin on llama.cpp's winner), else spin. Called before
    llama.cpp loads (OpenMP reads the wait policy once, when it loads), so the plan's
    fingerprint is checked without the llama.cpp build line, which needs llama.cpp loaded."""
    if cfg.thread_wait != "auto":
        return cfg.thread_wait, "set by --thread-wait"
    from .engine import plan as plan_mod
    from .models import file_fingerprint

    path, _ = cfg.resolved_plan()
    if path is None or not Path(path).exists() or Path(model_path).is_dir():
        return "spin", "no tuned plan for the model (run `appliance tune`)"
    try:
        plan = plan_mod.read(path)
    except plan_mod.PlanRefused as e:
        return "spin", f"the tuned plan cannot be read ({e})"
    here = plan_mod.current_fingerprint()
    if differs := [d for d in plan_mod.differences(plan.fingerprint, here) if not d.startswith("llama_cpp_build")]:
        return "spin", f"the tuned plan is not this machine's ({'; '.join(differs)})"
    entry = (plan.thread_waits or {}).get(file_fingerprint(Path(model_path)))
    if entry is None:
        return "spin", f"the plan {path} did not measure the thread wait on this model (run `appliance tune`)"
    return entry["thread_wait"], f"{path}: {entry.get('why', 'measured by appliance tune')}"
