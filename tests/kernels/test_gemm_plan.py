"""kernels.plan: buckets a pure and total function of M, the GEMM table round-tripped and
validated entry by entry, lookups that hit or miss (DEFAULT, remembered), and the search: every
candidate checked before it is timed, a wrong one dropped and never timed, near-ties to the
earlier candidate, and one reduction order (block_k, split_k, dot) across a shape's buckets.

Most searches here launch through a `run_fn` that computes each row on its own in float64
(fast, exact, batch-invariant); one runs the real kernel under the interpreter at a tiny shape."""
import json
import math

import pytest
import torch

from kernels import plan as P
from kernels.formats import dequantize_torch
from kernels.plan import GemmEntry, GemmKey, GemmTable, bucket
from kernels.wgemm import DEFAULT, GemmConfig, wgemm_torch

FP = {"device": "NVIDIA H200", "capability": "9.0", "runtime": "cuda 12.8", "driver": "570.1",
      "torch": "2.13.0", "triton": "3.9.0", "kernel_sources": "abc"}
KEY = GemmKey("wgemm", "q4_0", 64, 128)


def cfg(bm=16, bn=64, bk=128, sk=1, **kw) -> GemmConfig:
    return GemmConfig(bm, bn, bk, sk, **kw)


def table(**per_bucket) -> GemmTable:
    per = {b: GemmEntry(c, 10.0, 1e-3) for b, c in per_bucket.items()}
    return GemmTable(FP, {KEY: per})


TABLE = GemmTable(FP, {KEY: {"1-16": GemmEntry(cfg(sk=2), 12.5, 0.004),
                             "17-64": GemmEntry(cfg(32, 64, sk=2, num_warps=8), 30.25, 0.005),
                             "257+": GemmEntry(cfg(128, 128, sk=2, num_stages=4), 400.0, 0.006)},
                       GemmKey("wgemm", "nvfp4", 32, 256): {"1-16": GemmEntry(cfg(bk=64), 3.0, 0.01)}})


# ---------------------------------------------------------------------------- buckets

def test_bucket_is_pure_total_and_ordered():
    names = [bucket(m) for m in range(1, 3000)]
    assert set(names) == set(P.BUCKET_NAMES) and names == [bucket(m) for m in range(1, 3000)]
    order = [P.BUCKET_NAMES.index(b) for b in names]
    assert order == sorted(order)                                     # contiguous ranges, increasing
    edges = {1: "1-16", 16: "1-16", 17: "17-64", 64: "17-64", 65: "65-256", 256: "65-256", 257: "257+"}
    assert all(bucket(m) == b for m, b in edges.items()) and bucket(10 ** 9) == "257+"
    for m, b in {**P.BUCKET_M, **P.BUCKET_M_SMALL}.items():
        assert bucket(b) == m
    for bad in (0, -3, 1.5, True, "4"):
        with pytest.raises(ValueError, match="M must be"):
            bucket(bad)


# ---------------------------------------------------------------------- table and JSON

def test_the_table_round_trips_through_json_text():
    doc = TABLE.to_json()
    assert [(e["fmt"], e["bucket"]) for e in doc["entries"]] == [
        ("nvfp4", "1-16"), ("q4_0", "1-16"), ("q4_0", "17-64"), ("q4_0", "257+")]
    back = GemmTable.from_json(json.dumps(doc))
    assert back == TABLE and back.to_json() == doc and back.fingerprint == FP
    assert set(doc["entries"][0]) == {"op", "fmt", "n", "k", "bucket", "block_m", "block_n", "block_k", "split_k",
                                      "num_warps", "num_stages", "dot", "median_us", "checked_vs_ref", "max_rel_err"}


def _doc_with(i: int, **change) -> dict:
    doc = TABLE.to_json()
    doc["entries"][i] = {**doc["entries"][i], **change}
    return doc


@pytest.mark.parametrize("change, words", [
    ({"checked_vs_ref": False}, "checked_vs_ref must be true"),
    ({"bucket": "1-8"}, "unknown bucket"),
    ({"block_k": 96}, "power of two"),
    ({"block_k": 32}, "whole nvfp4 blocks"),                 # entry 0 is nvfp4 (blocks of 64)
    ({"max_rel_err": 0.5}, "over the bf16 bound"),
    ({"median_us": float("nan")}, "finite numbers"),
    ({"num_warps": 3}, "num_warps"),
    ({"dot": "fp8"}, "dot in"),
    ({"fmt": "q2_k"}, "no kernel format"),
    ({"k": 100}, "multiple of"),
    ({"measured": {}}, "unknown \\['measured'\\]"),
    ({"split_k": "2"}, "must be integers"),
])
def test_a_bad_entry_is_refused_naming_it(change, words):
    with pytest.raises(ValueError, match=r"gemm entry 0 \(wgemm .* N=32 K=.* bucket .*\): .*" + words):
        GemmTable.from_json(_doc_with(0, **change))


def test_a_missing_field_a_repeat_and_a_bad_section_are_refused():
    doc = TABLE.to_json()
    del doc["entries"][2]["median_us"]
    with pytest.raises(ValueError, match=r"gemm entry 2 .*missing \['median_us'\]"):
        GemmTable.from_json(doc)
    doc = TABLE.to_json()
    doc["entries"].append(dict(doc["entries"][1]))
    with pytest.raises(ValueError, match="gemm entry 4 .* repeats"):
        GemmTable.from_json(doc)
    for bad in ([], {"entries": []}, {"fingerprint": {"a": 1}, "entries": []}, {"fingerprint": {}, "entries": {}}):
        with pytest.raises(ValueError):
            GemmTable.from_json(bad)


def test_a_table_whose_buckets_disagree_on_the_reduction_is_refused():
    with pytest.raises(ValueError, match="q4_0 N=64 K=128: its buckets disagree on block_k/split_k/dot"):
        GemmTable.from_json(_doc_with(2, split_k=1))       # entry 2: q4_0 17-64, the others split 2
    for other in (dict(bk=64), dict(sk=4), dict(dot="fp16")):
        with pytest.raises(ValueError, match="disagree"):
            table(**{"1-16": cfg(), "65-256": cfg(64, **other)})
    table(**{"1-16": cfg(), "65-256": cfg(64, 128, num_warps=8, num_stages=4)})   # the rest may differ


# ---------------------------------------------------------------------------- lookups

def test_lookup_hits_and_misses_and_remembers_the_misses():
    t = GemmTable.from_json(TABLE.to_json())
    assert t.lookup("wgemm", "q4_0", 64, 128, 1) == (cfg(sk=2), True)
    assert t.lookup("wgemm", "q4_0", 64, 128, 40)[0].num_warps == 8
    assert t.lookup("wgemm", "q4_0", 64, 128, 4096)[0].block_m == 128
    assert not t.misses
    assert t.lookup("wgemm", "q8_0", 64, 128, 1) == (DEFAULT, False)              # unknown key
    got, hit = t.lookup("wgemm", "q4_0", 64, 128, 100)                             # known key, no 65-256
    assert not hit and got == t.entries[KEY]["17-64"].config                        # the nearest, the smaller on ties
    assert P._reduction(got) == P._reduction(t.entries[KEY]["1-16"].config)
    t.lookup("wgemm", "q8_0", 64, 128, 2)                                           # the same miss again
    assert t == TABLE                                                               # misses are not content
    assert t.drain_misses() == [(GemmKey("wgemm", "q4_0", 64, 128), "65-256"),
                                (GemmKey("wgemm", "q8_0", 64, 128), "1-16")]
    assert t.drain_misses() == [] and GemmKey("wgemm", "q8_0", 64, 128).miss("1-16") == {
        "op": "wgemm", "fmt": "q8_0", "n": 64, "k": 128, "bucket": "1-16"}


def test_merged_replaces_a_key_whole():
    new = {KEY: {"1-16": GemmEntry(cfg(bk=64), 5.0, 0.001)}, GemmKey("wgemm", "q8_0", 8, 32): {}}
    t = TABLE.merged(new)
    assert t.entries[KEY] == new[KEY] and len(t.entries) == 2 and TABLE.entries[KEY]["17-64"]


# ------------------------------------------------------------------------- fingerprint

def test_the_cpu_fingerprint_says_interpreter_and_hashes_the_kernel_sources():
    fp = P.gemm_fingerprint("cpu")
    assert fp["device"] == "cpu" and fp["capability"] == fp["runtime"] == "interpreter"
    assert fp["torch"] == str(torch.__version__) and len(fp["kernel_sources"]) == 64
    assert fp == P.gemm_fingerprint("cpu") and all(isinstance(v, str) for v in fp.values())
    assert set(fp) == set(FP)


def test_candidates_are_a_fixed_moderate_valid_list():
    for name in ("q4_0", "q4_1", "q8_0", "mxfp4", "nvfp4"):
        cands = P.candidates(name)
        assert 30 <= len(cands) <= 60 and len(set(cands)) == len(cands) and cands == P.candidates(name)
        fmt = P.format_of(name)
        for c in cands + P.candidates(name, small=True):
            c.check(fmt)
        assert len(P.candidates(name, small=True)) == 3
        assert len({c.dot for c in cands}) == 1
    assert P.candidates("q4_0")[0] == DEFAULT                       # ties go to the default


# ------------------------------------------------------------------------------ search

def rowwise(x, raw, fmt, k, config):
    """A stand-in kernel: each row on its own in float64, so exact and batch-invariant."""
    w = dequantize_torch(raw, fmt, k).double()
    return torch.stack([(x[i].double() @ w.T).float() for i in range(x.shape[0])])


SMALL_M = {"1-16": 2, "17-64": 20, "65-256": 70}


class Clock:
    """time_fn: a time per config from `times` (default 100 us); records what was timed."""

    def __init__(self, times=None):
        self.times, self.calls = times or (lambda c, m: 100.0), []

    def __call__(self, call, config, m):
        self.calls.append((config, m))
        call()
        return self.times(config, m)


def test_a_wrong_or_failing_candidate_is_dropped_and_never_timed():
    wrong, raising, bad = cfg(16, 32), cfg(16, 128), cfg(bk=96)
    good = cfg(16, 64)

    def run(x, raw, fmt, k, config):
        if config == raising:
            raise RuntimeError("out of resources: shared memory, Required: 262144")
        y = rowwise(x, raw, fmt, k, config)
        return y * 1.1 if config == wrong else y

    clock = Clock()
    res = P.search("wgemm", "q4_0", 64, 128, {"1-16": 2}, [wrong, raising, bad, good], clock, "cpu", run)
    assert [c for c, _ in clock.calls] == [good]
    assert res.entries["1-16"].config == good and res.entries["1-16"].checked_vs_ref
    reasons = {d.config: d.reason for d in res.dropped}
    assert set(reasons) == {wrong, raising, bad}
    assert "max_rel_err" in reasons[wrong] and "bf16 bound" in reasons[wrong]
    assert reasons[raising].startswith("RuntimeError: out of resources") and "power of two" in reasons[bad]


def test_nothing_passing_leaves_the_key_without_entries():
    res = P.search("wgemm", "q4_0", 64, 128, SMALL_M, [cfg()], Clock(), "cpu",
                   lambda x, raw, fmt, k, c: torch.zeros(x.shape[0], 64))
    assert res.entries == {} and res.timed == [] and len(res.dropped) == 1


def test_near_ties_go_to_the_earlier_candidate():
    a, b = cfg(16, 64), cfg(16, 32)
    pick = lambda t_b: P.search("wgemm", "q8_0", 32, 64, {"1-16": 1}, [a, b],
                                Clock(lambda c, m: 100.0 if c == a else t_b), "cpu", rowwise).entries["1-16"].config
    assert pick(98.5) == a and pick(97.0) == b


def test_every_bucket_of_a_key_shares_the_decode_winners_reduction():
    """Decode prefers block_k 64, split 2; the larger buckets would each prefer block_k 128
    unsplit, but may only choose among configs with the decode reduction."""
    cands = [cfg(16, 64, 128, 1), cfg(16, 32, 64, 2), cfg(32, 64, 128, 1), cfg(64, 64, 128, 1, num_warps=8)]

    def times(c, m):
        if m <= 16:
            return 50.0 if (c.block_k, c.split_k) == (64, 2) else 80.0
        return 10.0 if (c.block_k, c.split_k) == (128, 1) else 100.0 - c.block_m   # bigger tiles faster

    clock = Clock(times)
    res = P.search("wgemm", "q4_0", 64, 128, SMALL_M, cands, clock, "cpu", rowwise)
    assert set(res.entries) == set(SMALL_M)
    assert {P._reduction(e.config) for e in res.entries.values()} == {(64, 2, "bf16")}
    assert res.entries["1-16"].config == cfg(16, 32, 64, 2)
    assert res.entries["65-256"].config == cfg(64, 64, 64, 2, num_warps=8)      # block_m 64 fits M=70
    assert res.entries["17-64"].config == cfg(32, 64, 64, 2)                     # block_m 64 does not fit M=20
    assert all((c.block_k, c.split_k) == (64, 2) for c, m in clock.calls if m > 2)
    GemmTable(FP, {res.key: res.entries})                                        # a valid table


def test_a_candidate_whose_rows_depend_on_the_batch_is_dropped():
    """Within tolerance of the reference, but its first rows differ (by one ulp) from the decode
    winner's: a verify row would not reproduce the decode step, so it is never timed."""
    drift = cfg(32, 64)

    def run(x, raw, fmt, k, c):
        y = rowwise(x, raw, fmt, k, c)
        return torch.nextafter(y, torch.full_like(y, math.inf)) if c == drift else y

    clock = Clock()
    res = P.search("wgemm", "q4_0", 64, 128, {"1-16": 2, "17-64": 20}, [cfg(), drift], clock, "cpu", run)
    assert [(d.bucket, d.config) for d in res.dropped] == [("17-64", drift)]
    assert "not batch-invariant" in res.dropped[0].reason and (drift, 20) not in clock.calls
    assert res.entries["17-64"].config == cfg()


def test_the_search_launches_the_real_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    from kernels._triton import available
    if not available("cpu"):
        pytest.skip("the Triton interpreter is not on here")
    cands = P.candidates("nvfp4", small=True)
    res = P.search("wgemm", "nvfp4", 32, 128, {"1-16": 1, "17-64": 17}, cands, Clock(), "cpu")
    assert set(res.entries) == {"1-16", "17-64"} and not [d for d in res.dropped if "bound" in d.reason]
    assert len({P._reduction(e.config) for e in res.entries.values()}) == 1
    assert all(e.max_rel_err < 1e-5 for e in res.entries.values())      # float32 in the interpreter
    raw = P.quantized_weight("nvfp4", 32, 128)
    assert torch.equal(P.quantized_weight("nvfp4", 32, 128), raw)         # the same weight every time
    assert wgemm_torch(torch.ones(1, 128), raw, "nvfp4", 128).shape == (1, 32)


def test_search_refuses_a_bucket_measured_outside_it():
    with pytest.raises(ValueError, match="cannot be measured at M=20"):
        P.search("wgemm", "q4_0", 64, 128, {"1-16": 20}, [cfg()], Clock(), "cpu", rowwise)
    with pytest.raises(ValueError, match="unknown GEMM op"):
        P.search("matmul", "q4_0", 64, 128, {"1-16": 1}, [cfg()], Clock(), "cpu", rowwise)
