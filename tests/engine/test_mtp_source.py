"""Where the MTP head comes from (runners/mtp_source.py), decided from the GGUF headers before
llama.cpp loads anything: the model's own block, --mtp-model, or the mtp-*.gguf beside a trunk;
and why not. On the tiny glm4moe of gguf_mtp_fixture.py, whole and split as llama.cpp's
converter publishes it (no llama.cpp load here: test_mtp.py serves them)."""
from __future__ import annotations

import shutil

import pytest

from appliance.config import EngineConfig
from appliance.engine.runners.mtp_source import HeadLayout, HeadSource, choose, mismatch
from appliance.errors import ModelLoadError

from .gguf_mtp_fixture import MTP_ARCH, MtpDims, write_split_mtp, write_tiny_mtp


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{form: path}: the whole model; its trunk as the converter writes it (no next-n count) and
    one that still counts the layer, each alone in a folder and each with its sidecar; a head of
    another width."""
    d = tmp_path_factory.mktemp("heads")
    out = {"whole": d / "whole" / "tiny-glm-Q4_1.gguf"}
    out["whole"].parent.mkdir()
    write_tiny_mtp(out["whole"])
    for form, counted in (("trunk", False), ("counted", True)):
        (d / form).mkdir()
        (d / f"{form}-alone").mkdir()
        out[form], out[f"{form}-head"] = write_split_mtp(d / form, counted=counted)
        out[f"{form}-alone"] = d / f"{form}-alone" / out[form].name
        shutil.copy(out[form], out[f"{form}-alone"])
    out["narrow"] = d / "mtp-narrow.gguf"
    write_tiny_mtp(out["narrow"], dims=MtpDims(n_embd=64, n_head=2, n_head_kv=1), part="head")
    return out


def cfg(**kw) -> EngineConfig:
    return EngineConfig(engine="llamacpp", plan="off", **kw)


def test_each_file_says_what_it_holds(files):
    whole, trunk, counted, head = (HeadLayout.read(files[k]) for k in ("whole", "trunk", "counted", "trunk-head"))
    assert (whole.n_nextn, whole.has_block) == (1, True)
    assert (trunk.n_nextn, trunk.has_block) == (0, False)       # the converter's --no-mtp
    assert (counted.n_nextn, counted.has_block) == (1, False)   # a trunk that still counts it
    assert (head.n_nextn, head.has_block) == (1, True)
    assert {x.arch for x in (whole, trunk, counted, head)} == {MTP_ARCH}
    assert mismatch(trunk, head) is None and head.n_vocab == whole.n_vocab > 0


@pytest.mark.parametrize("form", ["trunk", "counted"])
def test_the_sidecar_beside_a_trunk_is_its_head(files, form):
    src = choose(cfg(), files[form])
    assert src == HeadSource(files[f"{form}-head"]) and src.name == "mtp-tiny-glm-Q4_1.gguf"
    assert not src.bundled          # the trunk loads without load_mtp


def test_the_models_own_block_first_then_mtp_model(files):
    own = choose(cfg(speculate="mtp"), files["whole"])
    assert own.path is None and own.bundled and own.name == "bundled" and own.refusal is None
    given = choose(cfg(mtp_model=str(files["trunk-head"])), files["whole"])
    assert given.path == files["trunk-head"] and not given.bundled


def test_the_best_of_several_sidecars(files, tmp_path):
    """Beside a Q4_1 trunk, of mtp- files for Q8_0, Q4_1 and Q4_0 the one of its own tag."""
    shutil.copy(files["trunk"], tmp_path / "tiny-glm-Q4_1.gguf")
    for tag in ("Q8_0", "Q4_0", "Q4_1"):
        shutil.copy(files["trunk-head"], tmp_path / f"mtp-tiny-glm-{tag}.gguf")
    assert choose(cfg(), tmp_path / "tiny-glm-Q4_1.gguf").name == "mtp-tiny-glm-Q4_1.gguf"


def test_without_a_head_it_says_why(files):
    counted = choose(cfg(speculate="mtp"), files["counted-alone"]).refusal
    assert "the model (glm4moe) counts 1 next-n (MTP) layer(s) but its GGUF leaves the block out" in counted
    assert "its head's sidecar, an mtp-*.gguf (the converter's --mtp), is not beside it in" in counted
    assert counted.endswith("give it with --mtp-model PATH")
    trunk = choose(cfg(), files["trunk-alone"]).refusal
    assert trunk.startswith("the model (glm4moe) has no next-n (MTP) layers, and no mtp-*.gguf beside it")
    assert choose(cfg(speculate="lookup"), files["whole"]).refusal == "--speculate lookup does not draft by MTP"


def test_a_sidecar_that_does_not_fit_the_model(files, tmp_path):
    """Named by --mtp-model: a load error with the reason. Found beside the model: only a
    reason not to draft by MTP (a stray file never stops a model from being served)."""
    with pytest.raises(ModelLoadError, match=r"--mtp-model .*mtp-narrow.gguf: its width is 64 and the model's 128"):
        choose(cfg(mtp_model=str(files["narrow"])), files["trunk"])
    with pytest.raises(ModelLoadError, match=r"--mtp-model .*: no such file"):
        choose(cfg(mtp_model=str(tmp_path / "nope.gguf")), files["trunk"])
    (tmp_path / "mtp-junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=r"--mtp-model .*mtp-junk.gguf: not a GGUF it can read"):
        choose(cfg(mtp_model=str(tmp_path / "mtp-junk.gguf")), files["trunk"])
    with pytest.raises(ModelLoadError, match=r"carries no next-n \(MTP\) block"):
        choose(cfg(mtp_model=str(files["trunk"])), files["whole"])
    shutil.copy(files["trunk"], tmp_path / "tiny-glm-Q4_1.gguf")
    shutil.copy(files["narrow"], tmp_path / "mtp-tiny-glm-Q4_1.gguf")
    found = choose(cfg(), tmp_path / "tiny-glm-Q4_1.gguf")
    assert found.path is None and "mtp-tiny-glm-Q4_1.gguf beside the model cannot be its MTP head: its width is 64" \
        in found.refusal


def test_mismatch_names_the_difference():
    model = HeadLayout("glm4moe", 128, 49152, 1, False)
    assert mismatch(model, HeadLayout("deepseek2", 128, 49152, 1, True)) == \
        "it is a deepseek2 head and the model is glm4moe"
    assert mismatch(model, HeadLayout("glm4moe", 128, 49153, 1, True)) == \
        "its vocabulary has 49153 tokens and the model's 49152"
    assert mismatch(model, HeadLayout("glm4moe", 128, 49152, 1, True)) is None
