"""Hugging Face checkpoint directories written at test time from a tiny GGUF: an NVIDIA ModelOpt
NVFP4 checkpoint (config.json, hf_quant_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) holding exactly the values of an NVFP4 GGUF, so that the torch runner on
the directory can be compared with llama.cpp and with itself on the GGUF.

Each NVFP4 matrix of the GGUF becomes ModelOpt's three tensors: its E2M1 codes repacked two to
a byte (element 2j in the low nibble), its E4M3 scales divided by the tensor scale, and the
tensor scale `weight_scale_2` (a power of two, so the division is exact; the writer checks it).
Other tensors are written in float32 as gguf dequantizes them. llama-style Q and K rows go
back to HF's order (the inverse of llama.cpp's converter permutation). The tokenizer is the
GGUF's (SmolLM2's byte-level BPE with its digit-splitting pre-tokenizer) in tokenizer.json's
format.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_EXPERTS = {"qwen3moe": ("mlp.gate", "mlp.experts.{e}.{p}_proj", {"gate": "gate", "up": "up", "down": "down"}),
            "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.{p}",
                        {"gate": "w1", "up": "w3", "down": "w2"})}
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def write_modelopt(src: Path, out: Path, kind: str, scale_2: float = 2.0 ** -4) -> Path:
    """The NVFP4 GGUF `src` (of tiny arch `kind`) as a ModelOpt checkpoint in `out`."""
    r = gguf.GGUFReader(src)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        for name, part in _split(t.name, kind, shape, t):
            hf = _hf_name(name, kind)
            rows = _hf_rows(name, arch, meta, part.shape[0]) if part.ndim == 2 else None
            if t.tensor_type == gguf.GGMLQuantizationType.NVFP4:
                packed, scale = _modelopt(part, scale_2)
                tensors[hf + ".weight"] = packed if rows is None else _unpermute(packed, rows)
                tensors[hf + ".weight_scale"] = scale if rows is None else _unpermute(scale, rows)
                tensors[hf + ".weight_scale_2"] = torch.tensor(scale_2, dtype=torch.float32)
                tensors[hf + ".input_scale"] = torch.tensor(1.0, dtype=torch.float32)   # W4A4's; unused
            else:
                values = torch.from_numpy(np.array(part, dtype=np.float32))
                tensors[hf + "." + name.rpartition(".")[2]] = values if rows is None else _unpermute(values, rows)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_config(meta, arch, kind, "output.weight" in {t.name for t in r.tensors})))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.35.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]}}))
    write_tokenizer(r, out)
    return out


def _split(name: str, kind: str, shape: tuple[int, ...], t):
    """(GGUF-style name, values as float32 or raw NVFP4 rows) for a tensor; 3-D experts one each."""
    quantized = t.tensor_type == gguf.GGMLQuantizationType.NVFP4
    data = np.asarray(t.data) if quantized else gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    if "_exps." in name:
        return [(name.replace("_exps.", f"_exps.{e}."), data[e]) for e in range(shape[0])]
    return [(name, data)]


def _hf_name(name: str, kind: str) -> str:
    stem = name.rpartition(".")[0]
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    if stem in top:
        return top[stem]
    parts = stem.split(".")
    layer = f"model.layers.{parts[1]}."
    if parts[2] == "ffn_gate_inp":
        return layer + _EXPERTS[kind][0]
    if parts[2].endswith("_exps"):
        return layer + _EXPERTS[kind][1].format(e=parts[3], p=_EXPERTS[kind][2][parts[2].split("_")[1]])
    return layer + _LAYER[parts[2]]


def _hf_rows(name: str, arch: str, meta: dict, n: int) -> np.ndarray | None:
    """GGUF's row order of a llama-style Q or K matrix (hf[rows] = gguf), else None."""
    short = name.split(".")[2] if name.startswith("blk.") else ""
    if arch != "llama" or short not in ("attn_q", "attn_k"):
        return None
    heads = int(meta[f"{arch}.attention.head_count"] if short == "attn_q" else meta[f"{arch}.attention.head_count_kv"])
    return np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)


def _unpermute(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    out = torch.empty_like(x)
    out[torch.from_numpy(rows)] = x
    return out


def _modelopt(raw: np.ndarray, scale_2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF NVFP4 rows uint8 [N, K/64 * 36] -> (packed uint8 [N, K/2], float8_e4m3fn [N, K/16])
    whose values times scale_2 are the GGUF's, exactly."""
    n = raw.shape[0]
    b = torch.from_numpy(np.array(raw)).reshape(n, -1, 36)
    scale = b[..., :4].reshape(n, -1).view(torch.float8_e4m3fn).float()          # [N, K/16]
    qs = b[..., 4:].reshape(n, -1, 4, 8)
    codes = torch.stack((qs & 0x0F, qs >> 4), -2).reshape(n, -1)                  # [N, K] in order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    new = (scale / scale_2).to(torch.float8_e4m3fn)
    assert torch.equal(new.float() * scale_2, scale), "the tensor scale must divide the block scales exactly"
    return packed.contiguous(), new.contiguous()


def _config(meta: dict, arch: str, kind: str, has_output: bool) -> dict:
    m = lambda key, default=None: meta.get(f"{arch}.{key}", default)   # noqa: E731
    n_head = int(m("attention.head_count"))
    c = {"architectures": [_HF_ARCH[kind]], "model_type": kind, "hidden_size": int(m("embedding_length")),
         "num_hidden_layers": int(m("block_count")), "intermediate_size": int(m("feed_forward_length", 0)),
         "num_attention_heads": n_head, "num_key_value_heads": int(m("attention.head_count_kv", n_head)),
         "head_dim": int(m("attention.key_length", int(m("embedding_length")) // n_head)),
         "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon")), "rope_theta": float(m("rope.freq_base")),
         "max_position_embeddings": int(m("context_length")), "vocab_size": 0,
         "tie_word_embeddings": not has_output, "torch_dtype": "bfloat16"}
    if kind in _EXPERTS:
        c["num_local_experts" if kind == "mixtral" else "num_experts"] = int(m("expert_count"))
        c["num_experts_per_tok"] = int(m("expert_used_count"))
        if kind == "qwen3moe":
            c["moe_intermediate_size"] = int(m("expert_feed_forward_length"))
            c["norm_topk_prob"] = True
    return c


def write_tokenizer(r: gguf.GGUFReader, out: Path) -> None:
    """The GGUF's byte-level BPE tokenizer as tokenizer.json and tokenizer_config.json."""
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    control = int(gguf.TokenType.CONTROL)
    vocab = {t: i for i, t in enumerate(tokens)}      # special tokens too, as Hugging Face writes them
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == control]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Digits", "individual_digits": True},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
          "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                              "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": vocab, "merges": list(merges)}}
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tc = {"bos_token": tokens[int(f["tokenizer.ggml.bos_token_id"].contents())],
          "eos_token": tokens[int(f["tokenizer.ggml.eos_token_id"].contents())],
          "add_bos_token": False, "add_eos_token": False}
    if "tokenizer.chat_template" in f:
        tc["chat_template"] = f["tokenizer.chat_template"].contents()
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
