"""Which files a pull reference means (no network)."""
from __future__ import annotations

import pytest

from appliance.library.refs import (RefError, choose, groups, has_quant, model_name, parse_ref, quant_bits,
                                     quant_tag, sibling)

REPO = ["README.md", "Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q4_K.gguf", "Qwen3-8B-Q8_0.gguf",
        "Qwen3-8B-UD-Q4_K_XL.gguf", "mmproj-Qwen3-8B-F16.gguf",
        "BF16/Qwen3-8B-BF16-00001-of-00002.gguf", "BF16/Qwen3-8B-BF16-00002-of-00002.gguf",
        "Q2_K/Broken-Q2_K-00001-of-00003.gguf", "Q2_K/Broken-Q2_K-00003-of-00003.gguf"]


def test_parse_ref_forms():
    assert parse_ref("org/repo") == parse_ref("hf.co/org/repo") == parse_ref("https://huggingface.co/org/repo/")
    r = parse_ref("org/Repo-GGUF:q8_0")
    assert (r.repo, r.quant, r.file) == ("org/Repo-GGUF", "q8_0", None)
    assert parse_ref("org/repo", "sub/x.gguf").file == "sub/x.gguf"
    for bad in ("repo", "org/repo/extra", "", "/repo"):
        with pytest.raises(RefError, match="not a Hugging Face repository"):
            parse_ref(bad)
    with pytest.raises(RefError, match="not both"):
        parse_ref("org/repo:Q4_K_M", "x.gguf")
    with pytest.raises(RefError, match="not a .gguf"):
        parse_ref("org/repo", "README.md")


def test_groups_keep_whole_splits_and_drop_projectors():
    g = groups(REPO)
    assert g["BF16/Qwen3-8B-BF16-00001-of-00002.gguf"] == ["BF16/Qwen3-8B-BF16-00001-of-00002.gguf",
                                                           "BF16/Qwen3-8B-BF16-00002-of-00002.gguf"]
    assert not any("mmproj" in k or "Broken" in k or k.endswith(".md") for k in g)
    assert len(g) == 5


def test_quant_tags_match_as_words():
    assert has_quant("Qwen3-8B-Q4_K_M.gguf", "q4_k_m")
    assert not has_quant("Qwen3-8B-Q4_K_M.gguf", "Q4_K")
    assert has_quant("Qwen3-8B-Q4_K.gguf", "Q4_K")
    assert has_quant("Qwen3-8B-UD-Q4_K_XL.gguf", "Q4_K_XL")
    assert has_quant("BF16/Qwen3-8B-BF16-00001-of-00002.gguf", "BF16")


def test_choose():
    assert choose(parse_ref("o/r"), REPO) == ["Qwen3-8B-Q4_K_M.gguf"]          # Q4_K_M by default
    assert choose(parse_ref("o/r:Q4_K"), REPO) == ["Qwen3-8B-Q4_K.gguf"]
    assert choose(parse_ref("o/r:bf16"), REPO) == groups(REPO)["BF16/Qwen3-8B-BF16-00001-of-00002.gguf"]
    # naming any part of a split takes the whole split
    assert len(choose(parse_ref("o/r", "BF16/Qwen3-8B-BF16-00002-of-00002.gguf"), REPO)) == 2
    assert choose(parse_ref("o/r"), ["only-F16.gguf", "x.md"]) == ["only-F16.gguf"]
    with pytest.raises(RefError, match="no model for Q5_K_M: .*Qwen3-8B-Q8_0.gguf"):
        choose(parse_ref("o/r:Q5_K_M"), REPO)
    with pytest.raises(RefError, match=r"no quant given, so Q4_K_M was looked for"):
        choose(parse_ref("o/r"), ["a-Q8_0.gguf", "a-F16.gguf"])
    with pytest.raises(RefError, match="has no file 'nope.gguf'"):
        choose(parse_ref("o/r", "nope.gguf"), REPO)
    with pytest.raises(RefError, match="no GGUF model files"):
        choose(parse_ref("o/r"), ["README.md", "mmproj-F16.gguf"])


def test_model_name():
    assert model_name("BF16/Qwen3-8B-BF16-00001-of-00002.gguf") == "Qwen3-8B-BF16"
    assert model_name("Qwen3-8B-Q4_K_M.gguf") == "Qwen3-8B-Q4_K_M"


def test_sidecars_are_not_models():
    """As llama.cpp's -hf judges a file by its name: projectors, importance matrices and draft
    heads' sidecars are never the model a pull takes."""
    paths = ["GLM-4.5-Air-Q4_K_M.gguf", "mtp-GLM-4.5-Air-Q4_K_M.gguf", "GLM-4.5-Air-MTP-Q8_0.gguf",
             "GLM-4.5-Air.imatrix.gguf", "eagle3-GLM.gguf", "dflash-GLM-Q8_0.gguf", "dspark-GLM.gguf",
             "sub/mmproj-GLM-F16.gguf"]
    # a model labelled in capitals as keeping its MTP layers is a model, as for llama.cpp
    assert list(groups(paths)) == ["GLM-4.5-Air-MTP-Q8_0.gguf", "GLM-4.5-Air-Q4_K_M.gguf"]
    assert choose(parse_ref("o/r"), ["mtp-GLM-Q4_K_M.gguf", "GLM-Q8_0.gguf"]) == ["GLM-Q8_0.gguf"]
    with pytest.raises(RefError, match="no GGUF model files"):
        choose(parse_ref("o/r"), ["mtp-GLM-Q4_K_M.gguf"])


def test_quant_tags_and_bits_as_llama_cpp_reads_them():
    assert quant_tag("Q4_K_M/GLM-Q4_K_M-00001-of-00003.gguf") == "Q4_K_M"
    assert quant_tag("mtp-glm-4.5-air-q8_0.gguf") == "Q8_0"
    assert quant_tag("Qwen3-8B.gguf") == "8B" and quant_tag("model.gguf") == "" and quant_tag("x.bin") == ""
    assert [quant_bits(t) for t in ("Q4_K_M", "BF16", "F16", "IQ2_XXS", "8B", "AIR", "")] == [4, 16, 16, 2, 8, 0, 0]


SIDECARS = ["mtp-GLM-Q8_0.gguf", "mtp-GLM-Q4_0.gguf", "mtp-GLM-Q4_K_M.gguf", "mtp-GLM-F16.gguf",
            "Q4_K_M/mtp-GLM-BF16.gguf", "Q8_0/mtp-GLM-Q8_0.gguf", "Q4_K_M/deeper/mtp-GLM-Q4_K_M.gguf",
            "Q4_K_M/GLM-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/GLM-Q4_K_M-00002-of-00002.gguf",
            "GLM-Q5_K_M.gguf", "GLM-Q4_K_M.gguf", "mmproj-GLM-F16.gguf", "README.md"]


def test_the_deepest_directory_comes_first():
    """A sidecar in the model's own directory beats one above it whatever its quant; one in
    another directory, or below the model's, is never taken."""
    model = "Q4_K_M/GLM-Q4_K_M-00001-of-00002.gguf"
    assert sibling(SIDECARS, model, "mtp-", "Q4_K_M") == "Q4_K_M/mtp-GLM-BF16.gguf"
    above = [p for p in SIDECARS if p != "Q4_K_M/mtp-GLM-BF16.gguf"]
    assert sibling(above, model, "mtp-", "Q4_K_M") == "mtp-GLM-Q4_K_M.gguf"   # then the tag, one up
    assert sibling(["Q8_0/mtp-GLM-Q8_0.gguf", "Q4_K_M/deeper/mtp-GLM-Q4_K_M.gguf"], model, "mtp-") is None


def test_an_exact_tag_then_the_nearest_bits():
    # the tag asked for, though Q4_0 has the same bits and comes first by name
    assert sibling(SIDECARS, "GLM-Q4_K_M.gguf", "mtp-", "q4_k_m") == "mtp-GLM-Q4_K_M.gguf"
    # without one, the bits nearest the model's: 5 -> Q4_0 (the first of the 4-bit ones)
    assert sibling(SIDECARS, "GLM-Q5_K_M.gguf", "mtp-") == "mtp-GLM-Q4_0.gguf"
    assert sibling(SIDECARS, "GLM-Q5_K_M.gguf", "mtp-", "Q8_0") == "mtp-GLM-Q8_0.gguf"
    assert sibling(SIDECARS, "GLM-BF16.gguf", "mtp-") == "mtp-GLM-F16.gguf"
    assert sibling(["GLM-Q4_K_M.gguf"], "GLM-Q4_K_M.gguf", "mtp-") is None
