"""A Hugging Face checkpoint directory (config.json and safetensors) read as the torch runner
reads a GGUF: the same metadata keys, the same tensor names, the same layout. Unquantized
checkpoints and NVIDIA ModelOpt NVFP4 ones (`hf_quant_config.json`, quant_algo NVFP4 or
W4A16_NVFP4) load; llama, Mistral, Mixtral, qwen2, qwen3 and qwen3moe architectures.

ModelOpt's NVFP4 layout, per quantized linear layer `P` (N outputs, K inputs):

    P.weight          uint8 [N, K / 2]          E2M1 codes, element 2j in the low nibble of byte j
    P.weight_scale    float8_e4m3fn [N, K / 16] one scale per 16 consecutive inputs
    P.weight_scale_2  float32 []                the tensor scale, multiplying
    P.input_scale     float32 []                activations' scale for W4A4 (unused: weight-only)

    W[n, k] = E2M1(code) * weight_scale[n, k // 16] * weight_scale_2

Layers a checkpoint leaves unquantized (`exclude_modules`, usually lm_head) are bf16 weights;
which is which is read from each tensor, not from the list. `blocks` gives an NVFP4 matrix in
GGUF's NVFP4 block layout (the same codes and E4M3 scale bits, reordered, no values changed)
with the tensor scale beside it, so `kernels.wgemm` multiplies it as stored and the output is
scaled once; `load` dequantizes (`kernels.formats.nvfp4_modelopt_torch`).

GGUF's converter reorders llama-style Q and K rows (HF's rotate-half RoPE to llama.cpp's
adjacent pairs); the same row permutation is applied here, so `model.py` runs unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

import gguf

from ....errors import ModelLoadError
from ....models import is_checkpoint_dir
from kernels.formats import nvfp4_modelopt_torch
from .weights import QuantBlocks

_MISSING = object()
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")

# HF architectures -> (GGUF architecture, router tensor, expert tensors gate/up/down, expert count key)
ARCHS = {
    "LlamaForCausalLM": ("llama", None, None, None),
    "MistralForCausalLM": ("llama", None, None, None),
    "MixtralForCausalLM": ("llama", "block_sparse_moe.gate", ("block_sparse_moe.experts.{e}.w1",
                           "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"), "num_local_experts"),
    "Qwen2ForCausalLM": ("qwen2", None, None, None),
    "Qwen3ForCausalLM": ("qwen3", None, None, None),
    "Qwen3MoeForCausalLM": ("qwen3moe", "mlp.gate", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                                                     "mlp.experts.{e}.down_proj"), "num_experts"),
}
# GGUF tensor name (after "blk.N.") -> HF module (after "model.layers.N.")
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_checkpoint(path: Path) -> bool:
    return is_checkpoint_dir(Path(path))


@dataclass(frozen=True)
class Shape:
    shape: tuple[int, ...]   # GGUF order, innermost first, as a GGUF tensor's shape reads


class HFWeights:
    """`weights.GGUFWeights`' interface (meta, has, blocks, load, tensors) over a checkpoint."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.config = _json(self.path / "config.json")
        arch_name = (self.config.get("architectures") or [None])[0]
        if arch_name not in ARCHS:
            raise ModelLoadError(f"{self.path}: architecture {arch_name!r} is not supported by the torch runner "
                                 f"(supported: {', '.join(ARCHS)})")
        self.arch, self.router, self.experts, expert_key = ARCHS[arch_name]
        self.quant = _quant_algo(self.path, self.config)
        self._files = {}
        for f in sorted(self.path.glob("*.safetensors")):
            handle = safe_open(str(f), framework="pt")
            self._files.update({name: handle for name in handle.keys()})
        self.n_expert = int(self.config.get(expert_key, 0)) if expert_key else 0
        self._meta = self._metadata()
        self.tensors = {name: Shape(tuple(reversed(self._shape_of(name)))) for name in self._names()}

    # -- what GGUFWeights answers ----------------------------------------------------------
    def meta(self, key: str, default: Any = _MISSING) -> Any:
        if key in self._meta:
            return self._meta[key]
        if default is _MISSING:
            raise ModelLoadError(f"{self.path}: config.json has no value for {key!r}")
        return default

    def meta_values(self) -> dict[str, Any]:
        """Every metadata key this checkpoint answers, GGUF-named (for its vocab file)."""
        return dict(self._meta)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def blocks(self, name: str) -> QuantBlocks:
        """An NVFP4 matrix in GGUF's NVFP4 layout with its tensor scale (see the module's
        docstring); anything else as a matrix no kernel reads as stored (`load` dequantizes)."""
        shape = self._shape(name)
        hf, kind = self._parts(name)
        if len(hf) == 1 and kind == "weight" and self._nvfp4(hf[0]) and shape[-1] % 64 == 0:
            packed, scale = self._raw(hf[0] + ".weight"), self._raw(hf[0] + ".weight_scale").view(torch.uint8)
            if int(scale.max()) < 0x80:          # positive scales: GGUF's UE4M3 reads the same bits
                rows = self._rows(name, shape[0])
                packed, scale = packed[rows], scale[rows]
                s2 = float(self._raw(hf[0] + ".weight_scale_2").float().reshape(-1)[0])
                return QuantBlocks(_to_gguf_nvfp4(packed, scale), gguf.GGMLQuantizationType.NVFP4, shape, s2)
        return QuantBlocks(np.zeros(0, dtype=np.uint8), gguf.GGMLQuantizationType.F32, shape)

    def load(self, name: str, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> torch.Tensor:
        got = self._shape(name)
        if got != tuple(shape):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        if name == "rope_freqs.weight":
            return self._rope_freqs().to(device=device, dtype=dtype)
        modules, kind = self._parts(name)
        rows = self._rows(name, got[0])
        parts = [self._dense(m, kind) for m in modules]
        values = parts[0][rows] if len(parts) == 1 else torch.stack(parts)
        return values.reshape(got).to(device=device, dtype=dtype)

    # -- names -------------------------------------------------------------------------------
    def _names(self) -> list[str]:
        names = [f"{g}.weight" for g, h in TOP.items() if f"{h}.weight" in self._files]
        if self._rope_scaling()[0] == "llama3":
            names.append("rope_freqs.weight")
        for i in range(int(self.config["num_hidden_layers"])):
            for short, module in LAYER.items():
                for kind in ("weight", "bias"):
                    if f"model.layers.{i}.{module}.{kind}" in self._files:
                        names.append(f"blk.{i}.{short}.{kind}")
            if self.router and f"model.layers.{i}.{self.router}.weight" in self._files:
                names += [f"blk.{i}.ffn_gate_inp.weight"] + [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        return names

    def _parts(self, name: str) -> tuple[list[str], str]:
        """The HF modules behind a GGUF tensor name (one, or one per expert) and which of their
        tensors it is ("weight" or "bias")."""
        stem, _, kind = name.rpartition(".")
        if not stem.startswith("blk."):
            return [TOP[stem]], kind
        _, i, short = stem.split(".", 2)
        base = f"model.layers.{i}."
        if short == "ffn_gate_inp":
            return [base + self.router], kind
        if short.endswith("_exps"):
            part = self.experts[("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps").index(short)]
            return [base + part.format(e=e) for e in range(self.n_expert)], kind
        return [base + LAYER[short]], kind

    def _shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        return self._shape_of(name)

    def _shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in PyTorch order, as `load` returns it."""
        if name == "rope_freqs.weight":
            return (self._rope_dim() // 2,)
        modules, kind = self._parts(name)
        key = f"{modules[0]}.{kind}"
        one = tuple(self._files[key].get_slice(key).get_shape())
        if kind == "weight" and self._nvfp4(modules[0]):
            one = (one[0], one[1] * 2)
        return (len(modules), *one) if len(modules) > 1 else one

    # -- values ------------------------------------------------------------------------------
    def _nvfp4(self, module: str) -> bool:
        return module + ".weight_scale" in self._files and self.quant in NVFP4_ALGOS

    def _raw(self, key: str) -> torch.Tensor:
        handle = self._files.get(key)
        if handle is None:
            raise ModelLoadError(f"{self.path}: tensor {key!r} is missing")
        return handle.get_tensor(key)

    def _dense(self, module: str, kind: str) -> torch.Tensor:
        """A module's weight (or bias) in float32, NVFP4 dequantized."""
        if kind == "weight" and self._nvfp4(module):
            return nvfp4_modelopt_torch(self._raw(module + ".weight"), self._raw(module + ".weight_scale"),
                                        self._raw(module + ".weight_scale_2"))
        return self._raw(f"{module}.{kind}").float()

    def _rows(self, name: str, n: int) -> torch.Tensor | slice:
        """llama-style Q and K rows in GGUF's order (its converter's permutation), else all."""
        short = name.split(".")[2] if name.startswith("blk.") else ""
        if self.arch != "llama" or short not in ("attn_q", "attn_k"):
            return slice(None)
        heads = int(self.config["num_attention_heads"]) if short == "attn_q" else self._kv_heads()
        return torch.arange(n).reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)

    # -- metadata ----------------------------------------------------------------------------
    def _kv_heads(self) -> int:
        c = self.config
        return int(c.get("num_key_value_heads") or c["num_attention_heads"])

    def _head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))

    def _rope_dim(self) -> int:
        return int(self._head_dim() * float(self.config.get("partial_rotary_factor", 1.0)))

    def _rope_scaling(self) -> tuple[str, dict]:
        s = self.config.get("rope_scaling") or {}
        kind = str(s.get("rope_type") or s.get("type") or "none")
        if kind not in ("none", "default", "linear", "llama3", "yarn"):
            raise ModelLoadError(f"{self.path}: RoPE scaling {kind!r} is not supported")
        return ("none" if kind == "default" else kind), s

    def _rope_freqs(self) -> torch.Tensor:
        """Llama 3's frequency factors, as llama.cpp's converter writes them (rope_freqs)."""
        _, s = self._rope_scaling()
        base, dim = float(self.config.get("rope_theta", 10000.0)), self._rope_dim()
        factor, low, high = float(s.get("factor", 8.0)), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old = float(s.get("original_max_position_embeddings", 8192))
        out = []
        for i in range(0, dim, 2):
            wavelen = 2 * math.pi * base ** (i / dim)
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return torch.tensor(out, dtype=torch.float32)

    def _metadata(self) -> dict[str, Any]:
        c, a = self.config, self.arch
        kind, scaling = self._rope_scaling()
        if self.arch == "qwen3moe" and (c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1):
            raise ModelLoadError(f"{self.path}: MoE models with dense layers are not supported")
        m = {"general.architecture": a, "general.name": self.path.name,
             f"{a}.context_length": int(c.get("max_position_embeddings", 2048)),
             f"{a}.embedding_length": int(c["hidden_size"]), f"{a}.block_count": int(c["num_hidden_layers"]),
             f"{a}.feed_forward_length": int(c.get("intermediate_size", 0)),
             f"{a}.attention.head_count": int(c["num_attention_heads"]),
             f"{a}.attention.head_count_kv": self._kv_heads(),
             f"{a}.attention.key_length": self._head_dim(), f"{a}.attention.value_length": self._head_dim(),
             f"{a}.attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
             f"{a}.rope.freq_base": float(c.get("rope_theta", 10000.0)),
             f"{a}.rope.dimension_count": self._rope_dim()}
        if kind in ("linear", "yarn"):   # as llama.cpp's converter writes them
            m[f"{a}.rope.scaling.type"], m[f"{a}.rope.scaling.factor"] = kind, float(scaling["factor"])
        if kind == "yarn" and "original_max_position_embeddings" in scaling:
            m[f"{a}.rope.scaling.original_context_length"] = int(scaling["original_max_position_embeddings"])
        if self.n_expert:
            m[f"{a}.expert_count"] = self.n_expert
            m[f"{a}.expert_used_count"] = int(c["num_experts_per_tok"])
            if "moe_intermediate_size" in c:
                m[f"{a}.expert_feed_forward_length"] = int(c["moe_intermediate_size"])
        return m


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None


def _quant_algo(path: Path, config: dict) -> str | None:
    """The checkpoint's ModelOpt algorithm (hf_quant_config.json, or config.json's
    quantization_config), None when unquantized; any other quantization is refused."""
    q = config.get("quantization_config")
    if (path / "hf_quant_config.json").is_file():
        q = _json(path / "hf_quant_config.json")
        q = q.get("quantization", q)
    if not q:
        return None
    algo = str(q.get("quant_algo") or "").upper()
    if algo not in NVFP4_ALGOS:
        method = q.get("quant_method") or q.get("quant_algo") or "unknown"
        raise ModelLoadError(f"{path}: quantization {method!r} is not supported (NVIDIA ModelOpt NVFP4 "
                             "checkpoints and unquantized ones are)")
    return algo


def _to_gguf_nvfp4(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """ModelOpt's packed codes uint8 [N, K/2] and E4M3 scale bytes [N, K/16] -> GGUF NVFP4 rows
    uint8 [N, K/64 * 36]: per 64 inputs, the 4 scale bytes, then per 16 inputs 8 bytes whose
    byte j holds element j (low nibble) and j + 8 (high). K a multiple of 64."""
    n = packed.shape[0]
    codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(n, -1, 4, 2, 8)   # [N, K/64, 4, 2, 8]
    qs = codes[..., 0, :] | (codes[..., 1, :] << 4)                                  # [N, K/64, 4, 8]
    blocks = torch.cat((scale.reshape(n, -1, 4), qs.reshape(n, -1, 32)), -1)
    return blocks.reshape(n, -1).contiguous().numpy()
