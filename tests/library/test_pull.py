"""`appliance pull`, `models` and `rm` against a fake Hub on localhost (HF_ENDPOINT): the files
land whole and checked, resume after an interruption, a corrupted transfer is refused, a split
model comes whole and loads, the Hub's 404s read clearly. No test reaches the network."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.cli import main
from tests.fit.conftest import hosts  # noqa: F401 (the fixture)

REPO = "tiny-org/Tiny-GGUF"


@pytest.fixture
def host_file(hosts, tmp_path):  # noqa: F811
    path = tmp_path / "vm.json"
    path.write_text(json.dumps(hosts["vm"]))
    return str(path)


def pull(*args: str, host: str) -> int:
    return main(["pull", *args, "--host", host])


def listed(*extra: str) -> dict[str, dict]:
    return {m["name"]: m for m in _models_json(*extra)}


def _models_json(*extra: str) -> list[dict]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["models", "--json", *extra]) == 0
    return json.loads(out.getvalue())


def test_pull_records_the_model_and_models_lists_it(hub, library, tiny, host_file, capsys):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"], "README.md": b"# tiny\n"})
    assert pull(REPO, host=host_file) == 0
    out, err = capsys.readouterr()
    dest = library / REPO / "tiny-F32.gguf"
    assert out.strip() == str(dest)
    assert dest.read_bytes() == tiny["one"]
    assert not list(library.rglob("*.part"))
    assert "fits" in err and "tiny-F32.gguf" in err          # the fit verdict, then the progress bar
    assert "pulled tiny-F32: " in err
    m = listed("--no-hf-cache")["tiny-F32"]
    assert (m["quant"], m["arch"], m["n_ctx_train"], m["chat_template"]) == ("F32", "llama", 512, True)
    assert m["size"] == len(tiny["one"]) and m["source"] == f"hf:{REPO}" and m["in_library"]
    assert m["origin"]["sha256"] == {"tiny-F32.gguf": hashlib.sha256(tiny["one"]).hexdigest()}
    assert m["origin"]["commit"] == "0123456789abcdef0123456789abcdef01234567"
    # the header was read by ranges before the download: the first GET asked for a range
    first_get = hub.downloads("tiny-F32.gguf")[0]
    assert first_get is not None and first_get.startswith("bytes=0-")
    # pulling again finds it in place and downloads nothing
    n = len(hub.downloads("tiny-F32.gguf"))
    assert pull(REPO, host=host_file) == 0
    assert "already in the library" in capsys.readouterr().err
    assert len(hub.downloads("tiny-F32.gguf")) == n
    # the table
    assert main(["models", "--no-hf-cache"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["NAME", "SIZE", "QUANT", "ARCH"]
    assert any(line.startswith("tiny-F32 ") and f"hf:{REPO}" in line for line in table)
    assert any("embedded" in line for line in table)


def test_quant_is_chosen_by_tag(hub, library, tiny, host_file, capsys):
    hub.add(REPO, {"tiny-Q4_K_M.gguf": tiny["one"], "tiny-Q8_0.gguf": tiny["one"]})
    assert pull(f"{REPO}:q8_0", host=host_file) == 0
    assert (library / REPO / "tiny-Q8_0.gguf").is_file()
    assert not (library / REPO / "tiny-Q4_K_M.gguf").exists()
    assert pull(f"{REPO}:Q5_K_M", host=host_file) == 1
    err = capsys.readouterr().err
    assert "has no model for Q5_K_M" in err and "tiny-Q4_K_M.gguf" in err


def test_interrupted_transfer_resumes_with_a_range(hub, library, tiny, host_file):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    cut = len(tiny["one"]) * 2 // 3
    hub.cut_after["tiny-F32.gguf"] = cut
    assert pull(REPO, host=host_file) == 0
    assert (library / REPO / "tiny-F32.gguf").read_bytes() == tiny["one"]
    # what reached the file before the cut (whole 10 MB chunks of huggingface_hub's) is kept
    ranges = [r for r in hub.downloads("tiny-F32.gguf") if r and not r.startswith("bytes=0-")]
    assert len(ranges) == 1 and 0 < int(ranges[0][len("bytes="):-1]) <= cut, ranges


def test_a_partial_file_from_an_earlier_run_is_resumed(hub, library, tiny, host_file):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    part = library / REPO / "tiny-F32.gguf.part"
    part.parent.mkdir(parents=True)
    half = len(tiny["one"]) // 2
    part.write_bytes(tiny["one"][:half])
    assert pull(REPO, host=host_file) == 0
    assert (library / REPO / "tiny-F32.gguf").read_bytes() == tiny["one"]
    assert not part.exists()
    assert hub.downloads("tiny-F32.gguf")[-1] == f"bytes={half}-"


def test_a_corrupted_transfer_is_refused_by_its_sha256(hub, library, tiny, host_file, capsys):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    hub.corrupt.add("tiny-F32.gguf")
    assert pull(REPO, host=host_file) == 1
    err = capsys.readouterr().err
    assert "sha256" in err and hashlib.sha256(tiny["one"]).hexdigest() in err
    assert not list((library / REPO).iterdir())              # neither the file nor a .part
    assert "tiny-F32" not in listed("--no-hf-cache")


def test_a_split_model_comes_whole_and_loads(hub, library, tiny, host_file):
    parts = {f"sub/{k}": v for k, v in tiny.items() if k.startswith("tiny-split")}
    hub.add(REPO, parts)
    assert pull(REPO, host=host_file) == 0
    m = listed("--no-hf-cache")["tiny-split"]
    assert [Path(f).name for f in m["files"]] == sorted(k.split("/")[1] for k in parts)
    assert m["size"] == sum(len(v) for v in parts.values())
    from appliance.fit.model import from_gguf

    facts = from_gguf(m["path"])               # every part's tensors, not the first part's only
    assert {t.role for t in facts.tensors} >= {"embed", "attn", "ffn", "output"}
    import llama_cpp

    llm = llama_cpp.Llama(model_path=m["path"], n_ctx=64, verbose=False)
    assert llm.n_vocab() > 0
    del llm


def test_the_hubs_404s_say_what_is_missing(hub, library, tiny, host_file, capsys):
    assert pull("nobody/nothing", host=host_file) == 1
    assert "nobody/nothing: no such repository on the Hub" in capsys.readouterr().err
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    assert pull(REPO, "other.gguf", host=host_file) == 1
    assert "has no file 'other.gguf'" in capsys.readouterr().err
    assert pull("not-a-ref", host=host_file) == 2


def test_a_model_that_does_not_fit_is_said_and_a_script_is_not_asked(hub, library, tiny, host_file, capsys):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    assert pull(REPO, "--n-slots", "2000000", host=host_file) == 0
    err = capsys.readouterr().err
    assert "DOES NOT FIT" in err and "would fit:" in err
    assert (library / REPO / "tiny-F32.gguf").is_file()


def test_rm_deletes_files_and_record(hub, library, tiny, host_file, capsys):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    assert pull(REPO, host=host_file) == 0
    assert main(["rm", "tiny-F32"]) == 0
    assert "removed tiny-F32" in capsys.readouterr().err
    assert not (library / "tiny-org").exists()                # empty directories pruned too
    assert "tiny-F32" not in listed("--no-hf-cache")
    assert main(["rm", "tiny-F32"]) == 1
    assert "not in the library" in capsys.readouterr().err


def test_models_finds_the_hf_cache_and_extra_directories(hub, library, tiny, tmp_path):
    # a Hugging Face cache laid out as huggingface_hub writes it: blobs, a snapshot of links, a ref
    repo_dir = Path(os.environ["HF_HOME"]) / "hub" / "models--other--Cached-GGUF"
    sha = hashlib.sha256(tiny["one"]).hexdigest()
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "blobs" / sha).write_bytes(tiny["one"])
    snap = repo_dir / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "cached-Q4_0.gguf").symlink_to(Path("../../blobs") / sha)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("a" * 40)
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "local-model.gguf").write_bytes(tiny["one"])
    (extra / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    found = listed("--models-dir", str(extra))
    assert found["cached-Q4_0"]["source"] == "hf-cache:other/Cached-GGUF"
    assert found["local-model"]["source"] == f"dir:{extra}" and found["local-model"]["arch"] == "llama"
    assert "truncated" in found["broken"]["error"]
    assert not found["local-model"]["in_library"]
    assert "cached-Q4_0" not in listed("--no-hf-cache")


def test_ctrl_c_leaves_no_file_under_the_final_name_and_the_next_pull_resumes(hub, library, tiny, host_file):
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"]})
    stall = len(tiny["one"]) * 2 // 3          # past huggingface_hub's first 10 MB write
    hub.stall_after["tiny-F32.gguf"] = stall
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # started with SIGINT ignored, as a background job of a script is: Ctrl-C must stop it anyway
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "pull", REPO, "--host", host_file],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    part = library / REPO / "tiny-F32.gguf.part"
    deadline = time.monotonic() + 60
    while not hub.stalled.is_set() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert hub.stalled.is_set(), proc.communicate()[1]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "resume" in err
    assert not (library / REPO / "tiny-F32.gguf").exists()
    kept = part.stat().st_size
    assert 0 < kept <= stall                 # what reached the file; the rest comes again
    assert tiny["one"].startswith(part.read_bytes())
    del hub.stall_after["tiny-F32.gguf"]
    assert pull(REPO, host=host_file) == 0
    assert (library / REPO / "tiny-F32.gguf").read_bytes() == tiny["one"]
    assert hub.downloads("tiny-F32.gguf")[-1] == f"bytes={kept}-"


def test_a_vision_models_projector_comes_with_it_is_served_with_it_and_goes_with_it(hub, library, tiny, host_file,
                                                                                    tmp_path, capsys):
    from appliance import config
    from appliance.library.catalog import catalog
    from tests.engine.mmproj_fixture import write_mmproj

    mmproj = write_mmproj(tmp_path / "mm.gguf").read_bytes()
    hub.add(REPO, {"tiny-F32.gguf": tiny["one"], "mmproj-tiny-Q8_0.gguf": mmproj, "mmproj-tiny-F16.gguf": mmproj})
    assert pull(REPO, host=host_file) == 0
    assert "sees images (mmproj-tiny-F16.gguf)" in capsys.readouterr().err
    m = listed("--no-hf-cache")["tiny-F32"]
    assert m["vision"] and m["mmproj"] == str(library / REPO / "mmproj-tiny-F16.gguf")   # F16 first
    assert not hub.downloads("mmproj-tiny-Q8_0.gguf")
    assert m["size"] == len(tiny["one"]) + len(mmproj)
    spec = next(s for s in catalog(config.load({"library": str(library)}, env={}))[0] if s.name == "tiny-F32")
    assert dict(spec.settings)["mmproj"] == m["mmproj"]        # serve loads it beside the model
    assert main(["models", "--no-hf-cache"]) == 0
    table = [re.split(r"\s{2,}", line) for line in capsys.readouterr().out.splitlines()]
    column = table[0].index("IMAGES")
    assert next(row for row in table if row[0] == "tiny-F32")[column] == "yes"
    assert main(["rm", "tiny-F32"]) == 0
    assert not (library / "tiny-org").exists()
    assert pull(REPO, "--no-mmproj", host=host_file) == 0
    assert not listed("--no-hf-cache")["tiny-F32"]["vision"]


def test_an_mtp_heads_sidecar_comes_with_its_trunk_is_served_with_it_and_goes_with_it(hub, library, host_file,
                                                                                       tmp_path, capsys):
    """A repository that publishes a model as llama.cpp's converter does with --no-mtp/--mtp: the
    trunk is the model (never a sidecar), the mtp-*.gguf of the quant asked for comes with it
    (not another quant's, not one in another folder), serve drafts with it, rm deletes it."""
    from appliance import config
    from appliance.engine.runners import mtp_source
    from appliance.library.catalog import catalog
    from tests.engine.gguf_mtp_fixture import write_split_mtp

    trunk, head = (p.read_bytes() for p in write_split_mtp(tmp_path))
    hub.add(REPO, {"tiny-glm-Q4_1.gguf": trunk, "mtp-tiny-glm-Q4_1.gguf": head, "mtp-tiny-glm-Q8_0.gguf": head,
                   "other/mtp-tiny-glm-Q4_1.gguf": head})
    assert pull(f"{REPO}:Q4_1", host=host_file) == 0
    assert "drafts with its MTP head (mtp-tiny-glm-Q4_1.gguf)" in capsys.readouterr().err
    m = listed("--no-hf-cache")["tiny-glm-Q4_1"]
    sidecar = library / REPO / "mtp-tiny-glm-Q4_1.gguf"
    assert m["path"] == str(library / REPO / "tiny-glm-Q4_1.gguf") and m["mtp"] == str(sidecar)
    assert sidecar.read_bytes() == head and m["size"] == len(trunk) + len(head)
    assert not hub.downloads("mtp-tiny-glm-Q8_0.gguf") and not hub.downloads("other/mtp-tiny-glm-Q4_1.gguf")
    assert "mtp-tiny-glm-Q4_1" not in listed("--no-hf-cache")          # never a model of its own
    cfg = config.load({"library": str(library)}, env={})
    spec = next(s for s in catalog(cfg)[0] if s.name == "tiny-glm-Q4_1")
    engine = spec.engine_config(cfg, default=False)
    assert engine.mtp_model == str(sidecar)                              # serve drafts with it
    assert mtp_source.choose(engine, spec.path) == mtp_source.HeadSource(sidecar)
    assert main(["rm", "tiny-glm-Q4_1"]) == 0
    assert not (library / "tiny-org").exists()
    assert pull(REPO, "--no-mtp", host=host_file) == 0                 # the only model, without its head
    assert "mtp" not in listed("--no-hf-cache")["tiny-glm-Q4_1"]
    assert not (library / REPO / "mtp-tiny-glm-Q4_1.gguf").exists()
