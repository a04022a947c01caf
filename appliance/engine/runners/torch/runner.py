"""The torch runner: the ModelRunner protocol over `model.py`, for `appliance serve --engine torch`.

Weights come from the GGUF through `weights.py`, or from a Hugging Face checkpoint directory
(unquantized, or NVIDIA ModelOpt NVFP4) through `hf.py`; text goes through llama.cpp's
tokenizer on a vocab-only load of the same file (of a checkpoint's tokenizer converted by
`hf_vocab.py`), so both runners turn the same text into the same ids.

Shapes: spans of up to DECODE_ROWS tokens (decode steps, speculative verifies) run together
in one forward, and every longer span (a prompt chunk) in a forward of its own, cut at
n_batch. The matmul kernels used compute each row independently of the others, and every
span's attention is row-wise (a short span's through `cpu_kernels`' attention on a CPU, each
row over exactly its own keys; a chunk's padded per row, model.Attention._attend_rows), as are
the CPU kernels' norms, RoPE and SwiGLU, so a row's logits and KV are the same whatever else
runs and however many rows its span has, and a prompt's are the same wherever it was cut into
chunks of more than DECODE_ROWS rows (all cuts with `--torch-cpu-kernels ops`).
probe.check_exact and cache.invariance prove both on the loaded model at start-up.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ....config import EngineConfig, default_data_dir
from ....errors import EngineFailure, ModelLoadError
from ....models import file_fingerprint
from ..base import RunnerInfo, Span
from ..vocab import TextMethods, Vocab, load_model
from ....fit.devices import GIB, Device
from ....fit.experts import ExpertPlan, plan_experts
from .fused import Fused
from .graphs import DecodeGraphs
from . import build, cpu_kernels, experts, hf, hf_vocab, model as model_mod, qlinear
from .kv import KVPool
from .weights import GGUFWeights

log = logging.getLogger("appliance.torch")

BUILDING = ("the C++ kernels are building (once per machine); torch ops serve meanwhile, and the engine moves "
            "to the kernels when it is next idle")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--torch-device {name}: this torch build sees no CUDA device")
    return dev


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN's bf16 matmul is then fast; without them it is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def use_kernels(setting: str, device: torch.device) -> bool:
    """Whether matrices in GGUF block formats go to `kernels.wgemm` (`--torch-kernels`)."""
    from kernels import available

    if setting == "triton" and not available(device):
        raise ModelLoadError(f"--torch-kernels triton: no Triton launch on {device} here (Triton missing, "
                             "or a CPU without TRITON_INTERPRET=1)")
    return setting == "triton" or (setting == "auto" and device.type == "cuda" and available(device))


class TunedGemm:
    """Each block matrix call's GEMM config from the tuned plan's GEMM entries (`kernels.plan`;
    looked up, never tuned while serving), remembered per (format, N, K, batch bucket), so a
    forward's hundreds of calls cost a dict lookup each. A shape the plan lacks takes the
    default config and is written once to the plan's misses file, for the next `tune --gemm`."""

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        from kernels import INTERPRET
        from kernels.plan import GemmKey, bucket, gemm_fingerprint
        from kernels.wgemm import DEFAULT, GemmConfig

        from ...plan import resolve_gemm

        self.path, explicit = cfg.resolved_plan()
        self.table, self.resolved = resolve_gemm(self.path, gemm_fingerprint(device), explicit)
        # under the interpreter (CPU tests) every program costs Python time: wide tiles
        self.default = GemmConfig(block_m=64, block_n=256, block_k=128) if INTERPRET else DEFAULT
        self._key, self._bucket = GemmKey, bucket
        self.chosen: dict[tuple[str, int, int, str], GemmConfig] = {}

    def __call__(self, fmt: str, n: int, k: int, m: int):
        memo = (fmt, n, k, self._bucket(m))
        config = self.chosen.get(memo)
        if config is None:   # first sight: the table's answer (a miss is remembered there)
            config, hit = self.table.lookup("wgemm", fmt, n, k, m)
            if not hit and self._key("wgemm", fmt, n, k) not in self.table.entries:
                config = self.default
            self.chosen[memo] = config
        return config

    def record_misses(self) -> None:
        from ...plan import record_miss

        for key, bucket in self.table.drain_misses():
            if self.path is not None:
                record_miss(self.path, key.miss(bucket))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TorchRunner(TextMethods):
    def __init__(self, cfg: EngineConfig, model_path: Path, model_name: str, defer_kernels: bool = False) -> None:
        threads = self._compute(cfg, defer_kernels)
        weights, vocab_path = open_weights(model_path)
        args = model_mod.ModelArgs.from_gguf(weights)
        if vocab_path is None:     # a Hugging Face checkpoint: its tokenizer as a vocab-only GGUF
            vocab_path = hf_vocab.vocab_file(model_path, weights.meta_values(), args.n_vocab, default_data_dir() / "vocab")
        self._llama = load_model(vocab_path, vocab_only=True)
        self.text = Vocab(self._llama)
        if self.text.n_vocab != args.n_vocab:
            raise ModelLoadError(f"{model_path}: the tokenizer has {self.text.n_vocab} tokens and "
                                 f"token_embd {args.n_vocab} rows")
        self.gemm = TunedGemm(cfg, self.device) if self.kernels else None
        self.int4 = (cfg.torch_int4 and self.device.type == "cpu" and self.dtype == torch.bfloat16
                     and qlinear.available() and not self.kernels)
        n_ctx, args = args.served(cfg, model_path)
        self.expert_plan = plan_offload(cfg, weights, args, self.dtype, self.device, n_ctx)
        offload = (experts.OffloadSpec(self.expert_plan.slots, self.expert_plan.compute, n_seq=cfg.n_slots)
                   if self.expert_plan.slots is not None else None)
        # packed while the kernels build, for them (or for torch's kernel while ops serve)
        setting = "ops" if self.kernels_pending else cfg.torch_cpu_kernels
        int4 = cpu_kernels.int4_layout(setting) if self.int4 else False
        self.model = build.load(weights, args, self.dtype, self.device, int4=int4, offload=offload,
                                    gemm=self.gemm,
                                    fused=Fused(args.spec.rope, args.rope_dim, args.n_head, args.head_dim,
                                                args.eps) if self.kernels else None)
        self.weights, self.args, self.n_batch, self.kv_dtype = weights, args, cfg.n_batch, self.dtype
        if self.model.experts is not None:
            log.info("expert cache: %s (copy %.2f GB/s measured)", self.expert_plan.reason,
                     self.model.experts.copy_gb_per_s)
        self._choose_cpu_kernels(cfg.torch_cpu_kernels)
        graphs = graph_mode(cfg.torch_graphs, self.kernels, bool(args.n_expert) or args.spec.gemma, self.device)
        self.kv = KVPool(args.n_layer, cfg.n_slots, n_ctx, args.n_head_kv, args.head_dim,
                         self.kv_dtype, self.device, spare=1 if graphs != "off" else 0)
        self.graphs = (DecodeGraphs(self.model, self.kv, cfg.n_slots, self.device, capture=graphs == "capture")
                       if graphs != "off" else None)
        if self.graphs is not None:
            self.graphs.capture()
        self.info = RunnerInfo(
            backend="torch", model_path=str(model_path), model_name=model_name, arch=args.arch,
            n_ctx=n_ctx, n_ctx_train=args.n_ctx_train, n_slots=cfg.n_slots, **self.text.facts(),
            kv_bytes=self.kv.nbytes,
            settings={"n_threads": threads, "n_batch": cfg.n_batch, "dtype": _name(self.dtype),
                      "device": str(self.device), "int4": self.int4,
                      "kernels": "triton" if self.kernels else "off", "kv_type": _name(self.kv_dtype),
                      **self._attention_settings(), **self._expert_settings(),
                      # a str, not torch's TorchVersion: that would import torch where unpickled
                      "torch": str(torch.__version__), "rope": args.rope.as_dict(),
                      "context": args.rope.describe(n_ctx, args.n_ctx_train),
                      **(self.graphs.settings() if self.graphs is not None else {"graphs": "off"})},
            fingerprint=file_fingerprint(model_path))

    def _compute(self, cfg: EngineConfig, defer_kernels: bool) -> int:
        """Device, dtype, threads (returned) and the Triton kernels' use; on a CPU, the C++
        kernels' build starts here, so that a first build compiles while the weights load.
        defer_kernels (the engine's start): a first build does not hold the start; torch ops
        serve meanwhile, the compiler at the lowest priority, and `upgrade` moves to the kernels
        once they are built."""
        self.device = resolve_device(cfg.torch_device)
        self.dtype = resolve_dtype(cfg.torch_dtype, self.device)
        threads, _ = cfg.resolved_threads()
        torch.set_num_threads(threads)
        self.kernels = use_kernels(cfg.torch_kernels, self.device)
        cpu = self.device.type == "cpu" and not self.kernels
        self.kernels_pending = defer_kernels and cpu and cfg.torch_cpu_kernels == "auto" and not cpu_kernels.built()
        if cfg.torch_cpu_kernels != "ops" and cpu:
            cpu_kernels.prefetch(background=self.kernels_pending)
        return threads

    def _choose_cpu_kernels(self, setting: str) -> None:
        """The CPU kernels (`cpu_kernels.choose`; torch ops while they build) or torch ops;
        short spans' attention through them, the fused one of the Triton kernels, or the ops."""
        k, self.cpu_kernels_note = cpu_kernels.choose("ops" if self.kernels_pending else setting, self.device,
                                                      self.kernels, self.args, self.kv_dtype, self.dtype)
        cpu_kernels.use(self.model, k)
        self.cpu_kernels = "cpp" if k is not None else ("off" if self.kernels or self.device.type != "cpu" else "ops")
        if self.kernels_pending:
            self.cpu_kernels, self.cpu_kernels_note = "building", BUILDING
        self.int4_matmul = ("cpp" if k is not None and k.int4 else "torch") if self.int4 else "off"
        cpp = k is not None and any(b.attn.cpu is not None for b in self.model.blocks)   # not a window's, not sinks'
        self.attention = "cpp" if cpp else ("fused" if self.kernels else "ops")

    def upgrade_ready(self) -> bool:
        """Whether `upgrade` has something to do: a deferred build of the kernels is done."""
        return self.kernels_pending and cpu_kernels.ready()

    def upgrade(self) -> bool:
        """After a deferred start, the C++ kernels once built (torch ops for good if the build
        failed): True when the settings changed, and with them the computed KV
        (`kv_fingerprint`) and what the start-up checks found (startup.upgrade runs them again).
        The engine calls it with no sequence running; the int4 matrices are repacked for them."""
        if not self.upgrade_ready():
            return False
        self.kernels_pending = False
        self._choose_cpu_kernels("auto")
        kept = {k: v for k, v in self.info.settings.items() if k != "cpu_kernels_note"}
        self.info = dataclasses.replace(self.info, settings={**kept, **self._attention_settings()})
        log.info("moved to the CPU kernels: %s", self._attention_settings())
        return True

    def _attention_settings(self) -> dict:
        return {"cpu_kernels": self.cpu_kernels, "attention": self.attention, "int4_matmul": self.int4_matmul,
                "int4_kept": qlinear.summary(cpu_kernels.int4_linears(self.model)),
                **({"cpu_kernels_note": self.cpu_kernels_note} if self.cpu_kernels_note else {})}

    def _expert_settings(self) -> dict:
        if not self.args.n_expert:
            return {}
        c = self.model.experts
        return {"expert_cache": c.slots if c is not None else "off",
                "expert_compute": c.compute if c is not None else "device",
                "expert_plan": self.expert_plan.reason}

    def expert_stats(self) -> experts.ExpertStats | None:
        c = self.model.experts
        return c.stats() if c is not None else None

    def expert_counts(self, slot: int) -> tuple[int, int] | None:
        """(lookups, hits) of the expert cache for sequence slot `slot` so far (None: no cache)."""
        c = self.model.experts
        return c.seq_counts(slot) if c is not None else None

    def kv_fingerprint(self) -> str:
        """What a saved state's validity depends on: the model file, the context, the KV dtype,
        torch's version, and the dtype, device, kernels, batch cut and threads that change the
        computed KV (torch's CPU matmuls may split their sums by thread; the CPU kernels and the
        attention path of short spans feed the next layer's K and V)."""
        s = self.info.settings
        parts = [self.info.fingerprint, f"n_ctx={self.info.n_ctx}", f"kv={s['kv_type']}",
                 *(f"{k}={s[k]}" for k in ("torch", "dtype", "device", "int4", "int4_kept", "kernels", "cpu_kernels", "attention",
                                           "int4_matmul", "n_batch", "n_threads")), self.args.rope.identity()]
        c = self.model.experts
        if c is not None and not c.same_memory and c.compute != "device":
            parts.append("experts=host-computed")   # CPU kernels for some rows: other bits
        return "|".join(parts)

    # -- compute -------------------------------------------------------------------------
    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(spans)
        # decode steps and verify spans together (each row is computed as it would be alone),
        # every longer span (a prompt chunk) in its own forward
        short = [i for i, s in enumerate(spans) if len(s.tokens) <= model_mod.DECODE_ROWS]
        if short:
            self._run([spans[i] for i in short], short, out)
        for i, s in enumerate(spans):
            if len(s.tokens) > model_mod.DECODE_ROWS:
                self._run_long(s, i, out)
        if self.gemm is not None and self.gemm.table.misses:
            self.gemm.record_misses()
        return out  # type: ignore[return-value]

    def _run_long(self, s: Span, i: int, out: list) -> None:
        """A prompt span in pieces of at most n_batch tokens, as the llama.cpp runner cuts it, so
        a whole prompt and the same prompt in grid chunks are computed in the same shapes."""
        rows = []
        for at in range(0, len(s.tokens), self.n_batch):
            piece = s.tokens[at:at + self.n_batch]
            left = len(s.tokens) - at - len(piece)               # tokens after this piece
            want = max(0, min(len(piece), s.n_logits - left))
            got: list = [None]
            self._run([Span(s.slot, piece, s.start_pos + at, want)], [0], got)
            rows.append(got[0])
        out[i] = rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _run(self, spans: Sequence[Span], where: Sequence[int], out: list) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        segs, rows = [], []
        for s in spans:
            segs.append(model_mod.Segment(s.slot, len(tokens), len(s.tokens), s.start_pos))
            rows.extend(range(len(tokens) + len(s.tokens) - s.n_logits, len(tokens) + len(s.tokens)))
            tokens.extend(s.tokens)
            positions.extend(range(s.start_pos, s.start_pos + len(s.tokens)))
        # denormal float32 arithmetic on x86 is ~20x slower: flush them while the model runs, and
        # only then (the flag is process state that other code, hypothesis for one, refuses)
        dev = self.device
        if self.model.experts is not None:
            self.model.experts.begin(np.repeat([s.slot for s in spans], [len(s.tokens) for s in spans]))
        torch.set_flush_denormal(True)
        try:
            if self.graphs is not None and all(len(s.tokens) == 1 and s.n_logits == 1 for s in spans):
                logits = self._graph_step(spans)
            else:
                logits = self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                            segs, torch.tensor(rows, dtype=torch.long, device=dev), self.kv)
        finally:
            torch.set_flush_denormal(False)
        logits = logits.cpu().numpy()
        at = 0
        for s, i in zip(spans, where):
            out[i] = logits[at:at + s.n_logits]
            at += s.n_logits

    def _graph_step(self, spans: Sequence[Span]) -> torch.Tensor:
        """One token a sequence through `graphs.DecodeGraphs` (a CUDA graph replayed on a GPU);
        the KV lengths kept here as `KVPool.write` keeps them."""
        for s in spans:
            if s.start_pos > self.kv.length[s.slot] or s.start_pos >= self.kv.n_ctx:
                raise EngineFailure(f"KV write at position {s.start_pos} of slot {s.slot}, which holds "
                                    f"{self.kv.length[s.slot]} of {self.kv.n_ctx}")
        logits = self.graphs([s.tokens[0] for s in spans], [s.start_pos for s in spans], [s.slot for s in spans])
        for s in spans:
            self.kv.length[s.slot] = s.start_pos + 1
        return logits

    # -- KV ------------------------------------------------------------------------------
    def truncate(self, slot: int, n_keep: int) -> None:
        self.kv.truncate(slot, n_keep)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.kv.copy_prefix(src, dst, n)

    def save(self, slot: int) -> bytes:
        return self.kv.save(slot)

    def restore(self, slot: int, blob: bytes) -> None:
        self.kv.restore(slot, blob)

    def close(self) -> None:
        if getattr(self, "_llama", None):
            import llama_cpp as L

            L.llama_model_free(self._llama)
            self._llama = None


def graph_mode(setting: str, kernels: bool, moe: bool, device: torch.device) -> str:
    """"capture" (CUDA graphs), "eager" (the same fixed-shape step, uncaptured) or "off": graphs
    need the kernels and a dense model of one rotation and no window (`moe` otherwise), and
    capture needs a CUDA device."""
    if setting == "off" or not kernels or moe:
        return "off"
    if setting == "eager":
        return "eager"
    return "capture" if device.type == "cuda" else "off"


def open_weights(path: Path) -> tuple[GGUFWeights | hf.HFWeights, Path | None]:
    """A GGUF (its own vocabulary), or a Hugging Face checkpoint directory (vocabulary: None,
    made from its tokenizer files)."""
    if hf.is_checkpoint(Path(path)):
        return hf.HFWeights(path), None
    return GGUFWeights(path), Path(path)


def plan_offload(cfg: EngineConfig, w: GGUFWeights | hf.HFWeights, args: model_mod.ModelArgs, dtype: torch.dtype,
                 device: torch.device, n_ctx: int) -> ExpertPlan:
    """The expert cache for this model on this device (`fit.experts.plan_experts`), sized from
    the tensors as this runner holds them (dequantized to `dtype`)."""
    size = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * args.expert_ff * args.dim * size
    other = sum(int(np.prod(t.shape)) for name, t in w.tensors.items() if "_exps." not in name) * size
    kv = args.n_layer * cfg.n_slots * n_ctx * 2 * args.n_head_kv * args.head_dim * size
    return plan_experts(cfg.expert_cache, cfg.expert_compute, n_experts=args.n_layer * args.n_expert if args.n_expert else 0,
                        expert_bytes=expert_bytes, device=_device_budget(device), resident_bytes=other + kv + GIB)


def _device_budget(device: torch.device) -> Device | None:
    """The GPU as the planner sees it: its free memory less a margin (None: a CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    margin = max(total // 50, GIB // 4)
    unified = bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
    return Device(torch.cuda.get_device_name(device), "gpu", max(free - margin, 0), unified=unified)
