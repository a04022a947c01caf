"""kernels.bench: the harness proved on CPU, the kernels under Triton's interpreter at tiny
shapes (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU). Timings there mean nothing
and nothing here looks at their size: a benchmark never asserts speed. What is checked: the
table and the JSON carry their fields, a wrong reference or kernel is reported as FAIL and not
timed, and the bandwidth limit is the published figure for a known device, measured otherwise."""
import contextlib
import io
import json
import math
from dataclasses import replace

import pytest
import torch

from kernels import INTERPRET, available, bench, bench_cases
from kernels import wgemm as wg
from kernels.bench_cases import BLOCK_32_FORMATS
from kernels.formats import FORMATS, dequantize_torch

needs_interpreter = pytest.mark.skipif(not (INTERPRET and available("cpu")),
                                       reason="needs Triton under TRITON_INTERPRET=1")
TINY = bench.SHAPES["tiny"]
ONE_EACH = replace(TINY, gemm_m=(1,), formats=("q4_0",), attn_rows=(1,), norm_n=(1,))
ENTRY_FIELDS = {"kernel", "shape", "check", "error", "tol", "bytes", "flops", "time_s", "ref_time_s",
                "speedup", "gb_s", "tflop_s", "frac_limit", "config", "note"}


def quiet_main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench.main(argv)
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    if not (INTERPRET and available("cpu")):
        pytest.skip("needs Triton under TRITON_INTERPRET=1")
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    rc, text = quiet_main(["--device", "cpu", "--json", str(path)])
    return rc, text, json.loads(path.read_text())


# -- the whole CPU path: python -m kernels.bench --device cpu --json FILE ----------------------

def test_cpu_run_prints_one_line_an_entry(tiny_run):
    rc, text, report = tiny_run
    assert rc == 0
    lines = text.splitlines()
    assert "interpreter timings" in text and "bandwidth limit" in text
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    for column in bench.COLUMNS:
        assert column in lines[header]
    body = lines[header + 1:header + 1 + len(report["entries"])]
    assert [line.split()[0] for line in body] == [e["kernel"].split()[0] for e in report["entries"]]
    assert lines[-2] == f"{len(report['entries'])} entries, 0 FAIL"


def test_cpu_run_json_has_the_fields(tiny_run):
    _, _, report = tiny_run
    assert report["device_type"] == "cpu" and report["mode"] == "tiny" and report["interpreter"]
    assert "interpreter" in report["timing"]
    assert report["limit"]["source"] == "measured" and report["limit"]["gb_s"] > 0
    kernels = {e["kernel"] for e in report["entries"]}
    assert kernels == {f"wgemm {f}" for f in BLOCK_32_FORMATS} | {"dense bf16", "decode_attention", "rms_norm",
                                                         "qk_norm_rope", "moe_gemm q8_0", "moe_gemm f32"}
    for e in report["entries"]:
        assert set(e) == ENTRY_FIELDS
        assert e["time_s"] > 0 and e["gb_s"] > 0 and e["frac_limit"] > 0 and e["bytes"] > 0
        gemm = e["kernel"].startswith(("wgemm", "dense", "moe_gemm"))
        assert (e["tflop_s"] is not None) == gemm and (e["flops"] is not None) == gemm
        if e["kernel"] == "dense bf16":                     # the ceiling: not checked
            assert e["check"] == "-" and e["ref_time_s"] is None
        else:
            assert e["check"] == "ok" and e["error"] <= e["tol"]
            assert e["ref_time_s"] > 0 and e["speedup"] == pytest.approx(e["ref_time_s"] / e["time_s"])


def test_wgemm_bytes_are_the_weights_activations_and_outputs(tiny_run):
    _, _, report = tiny_run
    e = next(e for e in report["entries"] if e["kernel"] == "wgemm q8_0" and e["shape"].startswith("M=20"))
    assert e["bytes"] == 32 * 4 * 34 + 20 * 128 * 4 + 20 * 32 * 4     # float32 x in the interpreter
    assert e["flops"] == 2 * 20 * 32 * 128


# -- a failing check ---------------------------------------------------------------------------

def make_case(kernel, ref, tol=1e-4):
    return bench.Case("k", "s", 64, None, tol, lambda: (kernel, ref))


def run_one(case):
    return bench.run_case(case, bench.Timer("cpu"), bench.Repeats(0, 1, 1), 100.0)


@pytest.mark.parametrize("kernel", [lambda: torch.ones(3) * 1.01, lambda: torch.full((3,), math.nan),
                                    lambda: torch.ones(4)])
def test_a_wrong_output_is_fail_and_not_timed(kernel):
    e = run_one(make_case(kernel, lambda: torch.ones(3)))
    assert e.check == "FAIL" and e.time_s is None and e.gb_s is None and e.ref_time_s is None
    assert "FAIL" in bench.table_line(e) and "max error" in bench.table_line(e)


def test_a_raising_kernel_is_fail():
    def boom():
        raise RuntimeError("no launch")
    e = run_one(make_case(boom, lambda: torch.ones(3)))
    assert e.check == "FAIL" and e.time_s is None and "RuntimeError: no launch" in bench.table_line(e)


def test_a_right_output_is_ok_and_timed():
    e = run_one(make_case(lambda: torch.ones(3) * (1 + 1e-6), lambda: torch.ones(3)))
    assert e.check == "ok" and e.time_s > 0 and e.gb_s == pytest.approx(64 / e.time_s / 1e9)
    assert e.frac_limit == pytest.approx(e.gb_s / 100.0)


@needs_interpreter
@pytest.mark.parametrize("wrong", ["wgemm_torch", "wgemm"])
def test_main_reports_a_wrong_reference_or_kernel(monkeypatch, tmp_path, wrong):
    real = getattr(wg, wrong)
    monkeypatch.setattr(wg, wrong, lambda *a, **kw: real(*a, **kw) * 1.1)
    monkeypatch.setitem(bench.SHAPES, "tiny", ONE_EACH)
    rc, text = quiet_main(["--device", "cpu", "--json", str(tmp_path / "k.json")])
    assert rc == 1                                   # a failed check, not speed, sets the status
    fails = [line for line in text.splitlines() if " FAIL " in line]
    assert len(fails) == 1 and fails[0].startswith("wgemm q4_0") and "max error" in fails[0]
    entries = json.loads((tmp_path / "k.json").read_text())["entries"]
    bad = [e for e in entries if e["check"] == "FAIL"]
    assert len(bad) == 1 and bad[0]["time_s"] is None and bad[0]["error"] > bad[0]["tol"]
    assert all(e["check"] in ("ok", "-") and e["time_s"] for e in entries if e is not bad[0])


# -- the bandwidth limit -----------------------------------------------------------------------

def never():
    raise AssertionError("a published figure needs no measurement")


@pytest.mark.parametrize("name, gb_s", [
    ("NVIDIA H200", 4800), ("NVIDIA H200 NVL", 4800), ("NVIDIA H100 80GB HBM3", 3350),
    ("NVIDIA H100 PCIe", 2000), ("NVIDIA A100-SXM4-80GB", 2000), ("NVIDIA A100-PCIE-40GB", 1550),
    ("NVIDIA GeForce RTX 4090", 1008), ("NVIDIA GeForce RTX 3090", 936), ("NVIDIA L40S", 864),
    ("AMD Instinct MI300X", 5300)])
def test_limit_of_a_known_device_is_the_published_figure(name, gb_s):
    limit = bench.bandwidth_limit(name, never)
    assert limit.source == "published" and limit.gb_s == pytest.approx(gb_s)
    assert "published" in limit.label


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA RTX A6000",
                                  "AMD EPYC", "cpu"])
def test_limit_of_another_device_is_measured(name):
    limit = bench.bandwidth_limit(name, lambda: 321.0)
    assert limit == bench.Limit(321.0, "measured", limit.label) and "copy_" in limit.label


def test_copy_measurement_counts_read_and_write():
    assert bench.measure_copy_gb_s("cpu", 1 << 20, repeats=3) > 0


# -- inputs and refusals -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_random_blocks_decode_to_finite_values(fmt):
    k = max(128, FORMATS[fmt].block)
    raw = bench_cases.random_blocks(fmt, 8, k, torch.Generator().manual_seed(0), "cpu")
    w = dequantize_torch(raw, fmt, k)
    assert torch.isfinite(w).all() and w.abs().max() > 0 and w.std() > 0


def test_cpu_without_the_interpreter_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench, "INTERPRET", False)
    assert bench.main(["--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("kernels.bench: ")
