"""`appliance fit`: GGUF tables read from files, the command's output, exit codes and refusals."""
from __future__ import annotations

import json
import os

import pytest

from appliance.cli import main
from appliance.fit.model import TIED_OUTPUT, from_gguf, role_of
from appliance.models import embedded_model_path
from tests.engine.gguf_fixtures import write_tiny


@pytest.fixture(scope="module")
def host_files(hosts, tmp_path_factory):
    d = tmp_path_factory.mktemp("snapshots")
    out = {}
    for name, snap in hosts.items():
        out[name] = d / f"{name}.json"
        out[name].write_text(json.dumps({"snapshot": snap, "advice": [], "unavailable": {}}))
    return out


def test_roles_by_name():
    assert role_of("token_embd.weight") == (None, "embed")
    assert role_of("output.weight") == (None, "output") and role_of("output_norm.weight") == (None, "output")
    assert role_of("blk.7.attn_q.weight") == (7, "attn") and role_of("blk.7.ffn_gate_inp.weight") == (7, "attn")
    assert role_of("blk.3.ffn_down.weight") == (3, "ffn") and role_of("blk.3.ffn_up_shexp.weight") == (3, "ffn")
    assert role_of("blk.12.ffn_gate_exps.weight") == (12, "expert")
    assert role_of("blk.0.ffn_norm.weight") == (0, "attn")


def test_a_moe_gguf_is_read_from_its_header(tmp_path):
    path = write_tiny(tmp_path / "moe.gguf", "qwen3moe", n_layer=3, n_expert=4, n_expert_used=2)
    m = from_gguf(path)
    assert (m.arch, m.n_layer, m.n_expert, m.n_expert_used, m.is_moe) == ("qwen3moe", 3, 4, 2, True)
    assert m.n_head_kv == (2, 2, 2) and m.key_length == 2 * 64 // 4     # qwen3's head_dim
    experts = [t for t in m.tensors if t.role == "expert"]
    assert len(experts) == 9 and all(t.ggml_type == "F32" for t in experts)
    # F32 [4 experts, 128, 64]
    assert next(t for t in experts if t.name == "blk.0.ffn_up_exps.weight").nbytes == 4 * 128 * 64 * 4
    size = os.path.getsize(path)
    assert 0.9 * size < m.weight_bytes <= size                       # the tensors are nearly all of the file


def test_the_embedded_model_and_its_tied_output():
    m = from_gguf(embedded_model_path())
    assert m.arch == "llama" and m.n_layer == 30 and m.n_head_kv == (3,) * 30
    tied = next(t for t in m.tensors if t.name == TIED_OUTPUT)
    embd = next(t for t in m.tensors if t.name == "token_embd.weight")
    assert tied.nbytes == embd.nbytes and tied.role == "output"
    assert m.weight_bytes <= os.path.getsize(embedded_model_path())  # the tied copy is not counted


def run(capsys, *argv):
    rc = main(["fit", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fit_prints_a_placement_for_another_host(capsys, host_files):
    rc, out, _ = run(capsys, "--shape", "gpt-oss-120b-MXFP4", "--host", str(host_files["desktop"]))
    assert rc == 0 and out.startswith("gpt-oss-120b-MXFP4: gpt-oss, 36 layers")
    assert "experts of the first" in out and "tensor overrides: blk" in out and "GPU0" in out
    rc, out, _ = run(capsys, "--shape", "gpt-oss-120b-MXFP4", "--host", str(host_files["desktop"]), "--json")
    data = json.loads(out)
    assert rc == 0 and data["fits"] and data["n_gpu_layers"] == 37 and data["n_cpu_moe"] > 0
    assert data["devices"]["GPU0"]["headroom"] >= 0 and data["overrides"][0].endswith("=CPU")


def test_fit_says_when_it_does_not_fit_and_what_would(capsys, host_files):
    rc, out, _ = run(capsys, "--shape", "Qwen3-30B-A3B-Q4_K_M", "--host", str(host_files["vm"]), "--n-slots", "8")
    assert rc == 1 and "DOES NOT FIT" in out and "would fit with --n-slots 4" in out
    assert "would fit with --kv-unified" in out
    rc, out, _ = run(capsys, "--shape", "Qwen3-30B-A3B-Q4_K_M", "--host", str(host_files["vm"]), "--n-slots", "8",
                     "--kv-unified")
    assert rc == 0 and "8 slots sharing 8,192 positions" in out


def test_fit_of_a_gguf_file_with_user_choices(capsys, host_files, tmp_path):
    path = write_tiny(tmp_path / "moe.gguf", "qwen3moe", n_layer=3)
    rc, out, _ = run(capsys, "--model", str(path), "--host", str(host_files["desktop"]), "--cpu-moe", "--json")
    data = json.loads(out)
    assert rc == 0 and data["n_cpu_moe"] == 3 and data["devices"]["GPU0"]["weights"]["expert"] == 0
    rc, out, _ = run(capsys, "--model", str(path), "--host", str(host_files["desktop"]), "--n-gpu-layers", "1",
                     "-ot", r"attn_q\.=CPU", "--json")
    data = json.loads(out)
    assert rc == 0 and data["n_gpu_layers"] == 1 and data["overrides"][0] == r"attn_q\.=CPU"


@pytest.mark.parametrize("argv, message", [
    (["-ot", "ffn=GPU7"], "no device 'GPU7' on this host (it has CPU, GPU0)"),
    (["-ot", "ffn(=CPU"], "bad regular expression"),
    (["-ot", "ffn"], "expected REGEX=DEVICE"),
    (["--n-gpu-layers", "many"], "--n-gpu-layers must be a number, auto or all"),
    (["--cpu-moe", "--n-cpu-moe", "3"], "not both"),
    (["--n-slots", "0"], "must be at least 1"),
])
def test_bad_input_is_refused_with_a_reason(capsys, host_files, argv, message):
    rc, out, err = run(capsys, "--shape", "Llama-3.1-8B-Q4_K_M", "--host", str(host_files["desktop"]), *argv)
    assert rc == 2 and message in err and out == ""


def test_unreadable_inputs_are_refused(capsys, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    rc, _, err = run(capsys, "--model", str(bad), "--host", str(bad))
    assert rc == 2 and "not a GGUF it can read" in err
    snap = tmp_path / "snap.json"
    snap.write_text("[1, 2]")
    rc, _, err = run(capsys, "--shape", "Llama-3.1-8B-Q4_K_M", "--host", str(snap))
    assert rc == 2 and "not a hostcheck snapshot" in err


def test_the_header_reader_agrees_with_gguf_s_own(tmp_path):
    import gguf

    from appliance.fit.gguf_header import StringArray, read_header

    for path in (embedded_model_path(),):   # quantised tensors, and the tokenizer's long arrays
        meta, infos = read_header(path)
        ref = gguf.GGUFReader(str(path))
        assert [(t.name, t.ggml_type, t.nbytes, list(t.shape), t.offset) for t in infos] == \
            [(t.name, t.tensor_type.name, int(t.n_bytes), [int(x) for x in t.shape], t.data_offset)
             for t in ref.tensors]
        assert set(meta) == {k for k in ref.fields if not k.startswith("GGUF.")}  # its own header fields
        for key, value in meta.items():
            theirs = ref.fields[key].contents()
            if isinstance(value, StringArray):   # a long array: its length only
                assert value.length == len(theirs) > 4096, key
            elif isinstance(theirs, str) or isinstance(theirs, list) and all(isinstance(x, str) for x in theirs):
                assert value == theirs, key
            else:
                assert value == pytest.approx(theirs), key


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, b"NOTAGGUF" * 8])
def test_the_header_reader_refuses_what_is_not_a_gguf(tmp_path, content):
    from appliance.fit.gguf_header import read_header

    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        read_header(path)
