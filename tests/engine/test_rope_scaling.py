"""RoPE scaling (`appliance/rope.py`): the flags resolved against a GGUF as llama.cpp resolves them,
bad input refused before anything loads, and the torch runner's scaled RoPE (its Python path, its
C++ CPU kernels, its Triton kernels under the interpreter) agreeing with llama.cpp's at positions
past the trained context, teacher-forced, as the runner's other agreement tests do.

The fixture is trained at 64 positions and served at 256 (with x8 scaling, which reaches 512): without the scaling, or with
linear where YaRN is asked for, or without YaRN's magnitude, the logits past position 64 differ
(the last test shows linear and YaRN disagree there, so the agreement is not luck)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from appliance import cli
from appliance.config import EngineConfig
from appliance.rope import ModelRope, resolve, served

from .gguf_fixtures import write_tiny
from .runner_kinds import HAVE_TORCH, make_runner

TEXT = (Path(__file__).parents[2] / "appliance" / "bench" / "prompts" / "filler.txt").read_text()
TRAINED, SERVED, N_TOKENS = 64, 256, 256
SMOL = ModelRope(n_ctx_train=8192, freq_base=100000.0)


# -- the flags against a model's metadata ------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    ({"n_ctx": 32768}, "--rope-scaling yarn (--rope-scale 4"),
    ({"n_ctx": 32768, "rope_scaling": "yarn", "rope_scale": 2}, "give --rope-scale 4"),
    ({"n_ctx": 32768, "rope_scaling": "yarn", "yarn_orig_ctx": 65536}, "--yarn-orig-ctx 65536 is larger"),
    ({"n_ctx": 32768, "rope_scaling": "yarn", "yarn_attn_factor": 1.2}, "--yarn-ext-factor 0"),
])
def test_contexts_the_model_cannot_be_served_at_are_refused(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        served(EngineConfig(**flags), SMOL)


@pytest.mark.parametrize("flags,message", [
    ({"rope_scaling": "ntk"}, "--rope-scaling must be one of none, linear, yarn"),
    ({"rope_scale": 0.0}, "--rope-scale must be positive"),
    ({"rope_freq_scale": -0.5}, "--rope-freq-scale must be positive"),
    ({"rope_scale": 4.0, "rope_freq_scale": 0.5}, "disagree"),
    ({"yarn_orig_ctx": 16384, "n_ctx": 8192}, "--yarn-orig-ctx 16384 is larger than the served context"),
    ({"yarn_ext_factor": 2.0}, "between 0 and 1"),
    ({"rope_scaling": "none", "rope_scale": 2.0}, "scales nothing"),
])
def test_bad_flags_are_refused_by_the_config(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**flags)


def test_defaults_come_from_the_gguf_and_the_served_context():
    yarn_file = ModelRope(n_ctx_train=32768, freq_base=1e6, kind="yarn", factor=4.0, orig_ctx=32768)
    n, r = served(EngineConfig(n_ctx=0), yarn_file)            # a YaRN GGUF gets it without flags
    assert (n, r.kind, r.factor, r.orig_ctx, r.ext_factor, r.source) == (32768, "yarn", 4.0, 32768, 1.0, "model")
    assert served(EngineConfig(n_ctx=131072), yarn_file)[0] == 131072
    n, r = served(EngineConfig(n_ctx=32768, rope_scaling="yarn"), SMOL)   # no factor: the one that reaches
    assert (r.factor, r.orig_ctx, r.freq_base, r.source) == (4.0, 8192, 100000.0, "flags")
    assert r.magnitude() == pytest.approx(1 + 0.1 * math.log(4))
    assert served(EngineConfig(), ModelRope(n_ctx_train=2048))[0] == 2048   # the default is at most the trained
    r = resolve(EngineConfig(n_ctx=16384, rope_scaling="linear", rope_freq_scale=0.5), SMOL, 16384)
    assert (r.ext_factor, r.pair_scale(8), r.magnitude()) == (0.0, [0.5] * 4, 1.0)
    r = resolve(EngineConfig(rope_scaling="yarn", rope_scale=4, yarn_ext_factor=0.0, yarn_attn_factor=1.3),
                SMOL, 8192)
    assert r.magnitude() == 1.3 and "YaRN x4 of 8,192" in r.describe(8192, 8192)


def test_yarn_ramp_is_ggml_s():
    """ggml's rope_yarn_ramp by pair: the fast pairs (below corr_dims' low) keep their angles,
    the slow ones (past high) are squeezed by the factor, linearly between."""
    r = resolve(EngineConfig(rope_scaling="yarn", rope_scale=4), SMOL, 32768)
    low, high = r.corr_dims(64)
    assert (low, high) == (10.0, 20.0)   # floor/ceil of 64 ln(8192 / (beta 2 pi)) / (2 ln 1e5), beta 32 and 1
    scale = r.pair_scale(64)
    assert scale[:11] == [1.0] * 11 and scale[20:] == [0.25] * 12
    assert scale[15] == pytest.approx(0.25 * 0.5 + 0.5)


def test_bench_raw_reference_scales_as_the_server_it_is_compared_with():
    from appliance.bench.raw import RawSettings

    _, r = served(EngineConfig(n_ctx=32768, rope_scaling="yarn"), SMOL)
    health = {"n_ctx": 32768, "n_slots": 1, "settings": {"n_threads": 2, "n_threads_batch": 2, "n_batch": 512,
                                                         "n_ubatch": 512, "flash_attn": False, "rope": r.as_dict()}}
    assert RawSettings.from_health(health, 512).rope == r
    del health["settings"]["rope"]                      # a server from before: the model's own
    assert RawSettings.from_health(health, 512).rope is None


def test_serve_refuses_before_loading(capsys):
    assert cli.main(["serve", "--n-ctx", "32768"]) == 2
    err = capsys.readouterr().err
    assert "past the model's trained context (8192 positions)" in err and "--rope-scaling yarn" in err


def test_fit_and_the_library_card_say_the_context(tmp_path, capsys):
    from appliance.fit.gguf_header import read_header
    from appliance.library.card import card_of

    path = write_tiny(tmp_path / "m.gguf", "llama", n_ctx=TRAINED, rope_scaling=("yarn", 8.0))
    card = card_of(*read_header(path))
    assert card.context() == "64 (yarn x8: 512)" and card.to_dict()["rope_scaling"] == "yarn x8: 512"
    assert card_of(*read_header(write_tiny(tmp_path / "plain.gguf", "llama", n_ctx=TRAINED))).context() == "64"
    base = ["fit", "--model", str(path)]
    assert cli.main([*base, "--n-ctx", "512", "--json"]) == 0     # the GGUF's YaRN, no flags
    assert "YaRN x8 of 64 (reaches 512; from the GGUF)" in capsys.readouterr().out
    assert cli.main([*base, "--n-ctx", "1024"]) == 2
    assert "give --rope-scale 16" in capsys.readouterr().err


# -- agreement with llama.cpp past the trained context -----------------------------------------

def agree(path: Path, cfg: EngineConfig) -> tuple[float, float, dict]:
    from appliance.quantize import agreement, teacher_forced

    ref, r = make_runner("llamacpp", cfg, path), make_runner("torch", cfg, path)
    try:
        ids = (ref.tokenize(TEXT, add_special=True) * 2)[:N_TOKENS]
        assert ref.info.n_ctx == r.info.n_ctx == SERVED and ref.info.n_ctx_train == TRAINED
        assert ref.info.settings["rope"] == r.info.settings["rope"]
        a, kl = agreement(teacher_forced(ref, ids)[TRAINED:], teacher_forced(r, ids)[TRAINED:])
        return a, kl, r.info.settings
    finally:
        ref.close()
        r.close()


CASES = {   # name: (arch, the torch runner's CPU path, the GGUF's own scaling, flags)
    "yarn-flags": ("llama", "ops", None, {"rope_scaling": "yarn", "rope_scale": 8.0}),
    "yarn-gguf": ("qwen3", "cpp", ("yarn", 8.0), {}),
    "linear-flags": ("qwen3", "cpp", None, {"rope_scaling": "linear", "rope_scale": 8.0}),
    "yarn-no-mix": ("llama", "cpp", None, {"rope_scaling": "yarn", "rope_scale": 8.0, "yarn_ext_factor": 0.0,
                                           "yarn_attn_factor": 1.3, "yarn_beta_fast": 16.0}),
}


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
@pytest.mark.parametrize("name", CASES)
def test_torch_rope_agrees_with_llama_cpp_past_the_trained_context(tmp_path, name):
    """float32, positions 64..256 of a model trained at 64: measured 100% argmax agreement, mean
    KL below 1e-6 for each (the same bound as the unscaled architectures' test). The Python
    path (ops) on llama's adjacent pairs, the C++ kernels on qwen3's and llama's."""
    arch, kernels, gguf_scaling, flags = CASES[name]
    path = write_tiny(tmp_path / "m.gguf", arch, n_ctx=TRAINED, n_layer=1, rope_scaling=gguf_scaling)
    cfg = EngineConfig(n_slots=1, n_ctx=SERVED, torch_dtype="float32", torch_cpu_kernels=kernels, **flags)
    a, kl, settings = agree(path, cfg)
    assert a >= 0.97 and kl < 0.01, (a, kl)
    assert settings["rope"]["factor"] == 8.0 and "reaches 512" in settings["context"]
    assert settings["cpu_kernels"] == kernels


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
def test_triton_rope_agrees_with_llama_cpp_past_the_trained_context(tmp_path):
    """The torch runner on its Triton kernels (the interpreter on a CPU): Q/K RoPE in
    kernels.norm_rope from the YaRN tables."""
    pytest.importorskip("triton")
    from kernels import INTERPRET

    if not INTERPRET:
        pytest.skip("the Triton check runs here under TRITON_INTERPRET=1 (a GPU: scripts/gpu_check.sh)")
    path = write_tiny(tmp_path / "m.gguf", "qwen3", n_ctx=TRAINED, n_layer=1)
    cfg = EngineConfig(n_slots=1, n_ctx=SERVED, torch_dtype="float32", torch_kernels="triton",
                       rope_scaling="yarn", rope_scale=8.0)
    a, kl, settings = agree(path, cfg)
    assert settings["kernels"] == "triton" and a >= 0.97 and kl < 0.01, (a, kl)


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
def test_linear_and_yarn_differ_past_the_trained_context(tmp_path):
    """The agreement above is not luck: the same model with linear scaling in place of YaRN
    gives other argmaxes past the trained context (the rotation is seen in the logits)."""
    from appliance.quantize import agreement, teacher_forced

    path = write_tiny(tmp_path / "m.gguf", "llama", n_ctx=TRAINED)
    runners = [make_runner("llamacpp", EngineConfig(n_slots=1, n_ctx=SERVED, rope_scaling=kind, rope_scale=8.0), path)
               for kind in ("linear", "yarn")]
    try:
        ids = (runners[0].tokenize(TEXT, add_special=True) * 2)[:N_TOKENS]
        a, _ = agreement(*(teacher_forced(r, ids)[TRAINED:] for r in runners))
        assert a < 0.9, a
    finally:
        for r in runners:
            r.close()


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (the torch extra)")
def test_a_yarn_checkpoint_is_read_as_llama_cpp_s_converter_writes_it(tmp_path):
    """A Hugging Face config.json's rope_scaling {rope_type: yarn} (refused before issue 50)
    becomes the GGUF keys that llama.cpp's converter writes, and the torch runner's ModelArgs."""
    import json

    import torch
    from safetensors.torch import save_file

    from appliance.engine.runners.torch.args import ModelArgs
    from appliance.engine.runners.torch.hf import HFWeights

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": TRAINED, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": TRAINED}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 64)}, str(tmp_path / "model.safetensors"))
    w = HFWeights(tmp_path)
    assert {k: v for k, v in w.meta_values().items() if ".scaling." in k} == {
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 8.0,
        "llama.rope.scaling.original_context_length": TRAINED}
    n_ctx, args = ModelArgs.from_gguf(w).served(EngineConfig(n_ctx=SERVED), tmp_path)
    assert n_ctx == SERVED and (args.rope.kind, args.rope.factor, args.rope.orig_ctx) == ("yarn", 8.0, TRAINED)


def test_a_draft_model_takes_its_own_rotation_and_yarn_past_its_training(tmp_path):
    """The RoPE flags are the served model's; a draft model trained for fewer positions than
    the served context drafts there with YaRN (its drafts are verified) instead of refusing."""
    from appliance.engine.startup import ROPE_FIELDS, draft_rope

    short = write_tiny(tmp_path / "short.gguf", "llama", n_ctx=512)
    assert draft_rope(short, 512) == dict.fromkeys(ROPE_FIELDS)
    assert draft_rope(short, 2048) == {**dict.fromkeys(ROPE_FIELDS), "rope_scaling": "yarn", "rope_scale": 4}
    own = write_tiny(tmp_path / "own.gguf", "llama", n_ctx=512, rope_scaling=("yarn", 8.0))
    assert draft_rope(own, 2048) == dict.fromkeys(ROPE_FIELDS)   # its GGUF's own scaling reaches it
