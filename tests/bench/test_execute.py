"""The plan executor: cells are stored as they are measured, a refused cell is skipped and named,
Ctrl-C and a dead server end the run with every completed cell kept and the rest named."""
from __future__ import annotations

import pytest

from appliance.bench.client import CellFailed, ServerGone
from appliance.bench.session import Step, execute
from appliance.store import ModelFingerprint, ResultCell, RunStatus, Store

FP = ModelFingerprint("m.gguf", "0" * 64, "F32", 1)


def cell(label: str) -> ResultCell:
    return ResultCell(mode="serial", prompt_set="sweep", depth=8, prompt_tokens=8, generated_tokens=4,
                      ttft_ms=1.0, prefill_tps=8000.0, client_decode_tps=100.0, engine_decode_tps=100.0,
                      tokens_per_step=1.0, extra={"cell": label})


def ok(label: str) -> Step:
    return Step(label, 0, "", "served", lambda: [cell(label)])


def raising(label: str, exc: BaseException) -> Step:
    def run():
        raise exc
    return Step(label, 0, "", "served", run)


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "r.db") as s:
        yield s


def run(store, steps):
    run_id = store.start_run(["test"], {}, FP)
    outcome = execute(store, run_id, steps, progress=False)
    return outcome, [c.extra["cell"] for c in store.results(run_id)]


def test_a_complete_plan(store):
    outcome, stored = run(store, [ok("a"), ok("b")])
    assert outcome.status is RunStatus.COMPLETE and outcome.missing == [] and outcome.note() == ""
    assert stored == ["a", "b"]


def test_a_refused_cell_is_skipped_and_named(store):
    outcome, stored = run(store, [ok("a"), raising("b", CellFailed("HTTP 400: too long")), ok("c")])
    assert stored == ["a", "c"] and outcome.status is RunStatus.FAILED
    assert outcome.missing == ["b [served] run 1"]
    assert "b [served] run 1: HTTP 400: too long" in outcome.note()


@pytest.mark.parametrize("exc, status", [(KeyboardInterrupt(), RunStatus.INTERRUPTED),
                                         (ServerGone("the server stopped answering"), RunStatus.FAILED)])
def test_an_ended_run_keeps_what_was_done_and_names_the_rest(store, exc, status):
    outcome, stored = run(store, [ok("a"), raising("b", exc), ok("c")])
    assert stored == ["a"] and outcome.status is status
    assert outcome.missing == ["b [served] run 1", "c [served] run 1"]
    assert "2 of 3 cells missing" in outcome.note()


def test_no_raw_reference_for_a_server_that_is_not_llama_cpp():
    """The raw reference mirrors a llama.cpp server's settings; a torch server has none to mirror
    (and its /health lacks them): no raw rows, rather than a KeyError."""
    from appliance.bench.session import Variant, maybe_raw

    health = {"backend": "torch", "n_ctx": 512, "n_slots": 1, "settings": {"n_threads": 2, "n_batch": 512}}
    variant = Variant("", None, "m", 512, 1, health)  # type: ignore[arg-type]
    with maybe_raw("/some/model.gguf", variant, 512, True) as raw:
        assert raw is None


def test_no_raw_reference_beside_a_server_with_weights_off_the_cpu(tmp_path):
    """The raw reference computes on the CPU alone: beside a server whose placement holds weights
    on a GPU or an RPC worker its rows would not mirror it, so there are none; a server whose
    weights are all in host memory gets them (its raw worker loads the model)."""
    from appliance.bench.session import Variant, maybe_raw, off_the_cpu

    from ..engine.gguf_fixtures import write_tiny_llama

    settings = {"n_threads": 2, "n_threads_batch": 2, "n_batch": 512, "n_ubatch": 512, "flash_attn": False}
    cpu = {"weights": {"attn": 10, "ffn": 20}, "kv": 5}
    placed = {"devices": {"CPU": cpu, "RPC[10.0.0.2:50052]": {"weights": {"attn": 0, "ffn": 40}, "kv": 5},
                          "GPU0": {"weights": {"attn": 0}, "kv": 0}}}
    assert off_the_cpu({"placement": placed}) == "RPC[10.0.0.2:50052]"
    assert off_the_cpu({"placement": {"devices": {"CPU": cpu}}}) == "" and off_the_cpu({}) == ""
    model = str(write_tiny_llama(tmp_path / "tiny.gguf"))
    for placement, mirrored in ((placed, False), ({"devices": {"CPU": cpu}}, True)):
        health = {"backend": "llama.cpp", "n_ctx": 128, "n_slots": 1, "settings": settings, "placement": placement}
        with maybe_raw(model, Variant("", None, "m", 128, 1, health), 64, True) as raw:  # type: ignore[arg-type]
            assert (raw is not None) == mirrored


def _variant(label: str, modes: list[str] | None, reason: str = "not exact"):
    from appliance.bench.session import Target, Variant

    spec = None if modes is None else {"modes": modes, "reason": reason}
    health = {"settings": {"speculation": spec}} if spec is not None else {"settings": {}}
    return Variant(label, Target(f"http://{label or 'x'}"), "m", 512, 1, health)


def test_a_mode_one_side_refuses_is_measured_on_the_other_side_only(capsys):
    from types import SimpleNamespace

    from appliance.bench.client import BenchError
    from appliance.bench.plans import _offered_modes

    ab = SimpleNamespace(variants=[_variant("A", []), _variant("B", ["lookup"])])
    assert _offered_modes(ab, ("serial", "lookup")) == {"A": {"serial"}, "B": {"serial", "lookup"}}
    assert "on one side only: http://A refuses it: not exact" in capsys.readouterr().err
    with pytest.raises(BenchError, match="mode 'draft'.*no draft model"):
        _offered_modes(ab, ("serial", "draft"))
    with pytest.raises(BenchError, match="not exact"):
        _offered_modes(SimpleNamespace(variants=[_variant("", [])]), ("lookup",))
    with pytest.raises(BenchError, match="not an appliance server"):
        _offered_modes(SimpleNamespace(variants=[_variant("", None)]), ("lookup",))
    with pytest.raises(BenchError, match="not available"):
        _offered_modes(ab, ("medusa",))
