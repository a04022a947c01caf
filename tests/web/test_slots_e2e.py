"""llama-server's slot routes on a running server over the embedded model (one server for the
module): GET /slots's shape, a slot saved, erased and restored into another slot, then the same
prompt answered from the restored positions with the same text; files from another model or
layout, corrupt ones, bad names and bad slots refused with a 400; a restore into a busy slot
waiting for its request, as llama-server defers it."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from .conftest import running_server

STORY = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 12


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slots")
    # no disk tier: an erased slot's prompt is nowhere else, so a hit after a restore is the restore's
    with running_server(tmp, "--n-ctx", "1024", "--n-slots", "2", "--prefill-chunk", "128",
                        "--cache-disk-bytes", "0", "--slot-save-path", str(tmp / "saved")) as server:
        server.saved = tmp / "saved"
        yield server


def complete(srv, **extra) -> dict:
    r = requests.post(srv.url + "/completion", timeout=120, json={
        "prompt": STORY, "n_predict": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def slots(srv) -> list[dict]:
    r = requests.get(srv.url + "/slots", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def act(srv, slot, action: str, filename: str | None = None) -> requests.Response:
    body = {} if filename is None else {"filename": filename}
    return requests.post(f"{srv.url}/slots/{slot}?action={action}", json=body, timeout=120)


def test_save_erase_restore_then_answered_from_the_restored_slot(srv):
    fresh = slots(srv)
    assert [s["id"] for s in fresh] == [0, 1]
    assert all(s["n_ctx"] == 1024 and not s["is_processing"] and "speculative" in s for s in fresh)
    cold = complete(srv)
    assert cold["timings"]["cache_n"] == 0
    [used] = [s for s in slots(srv) if "id_task" in s]
    assert used["n_prompt_tokens"] >= 128 and used["params"]["temperature"] == 0
    assert used["next_token"][0]["n_decoded"] == 8 and not used["next_token"][0]["has_next_token"]
    saved = act(srv, used["id"], "save", "story.bin").json()
    assert saved["id_slot"] == used["id"] and saved["filename"] == "story.bin"
    assert saved["n_saved"] == used["n_prompt_tokens"] and saved["n_written"] == (srv.saved / "story.bin").stat().st_size
    assert saved["timings"]["save_ms"] > 0
    assert act(srv, used["id"], "erase").json() == {"id_slot": used["id"], "n_erased": saved["n_saved"]}
    assert slots(srv)[used["id"]]["n_prompt_tokens"] == 0
    other = 1 - used["id"]
    restored = act(srv, other, "restore", "story.bin").json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    assert slots(srv)[other]["n_prompt_tokens"] == saved["n_saved"]
    warm = complete(srv)
    # reused as any slot's prompt is (to the token less the few the grid recomputes): only the
    # restore can have put it there (the slot it ran in was erased, there is no disk tier)
    assert 128 <= warm["timings"]["cache_n"] == warm["tokens_cached"] <= saved["n_saved"]
    assert warm["content"] == cold["content"]
    assert slots(srv)[other]["id_task"] > used["id_task"]     # it ran where the state was restored


def write_like(srv, source: str, target: str, **header) -> None:
    """A copy of a saved file with header fields changed (its blob and checksum kept)."""
    raw = (srv.saved / source).read_bytes()
    magic_end = raw.index(b"\n") + 1
    line_end = raw.index(b"\n", magic_end)
    head = json.loads(raw[magic_end:line_end])
    head.update(header)
    (srv.saved / target).write_bytes(raw[:magic_end] + json.dumps(head).encode() + raw[line_end:])


def test_files_that_must_not_load_and_bad_requests_are_400s(srv):
    complete(srv)
    holding = max(slots(srv), key=lambda s: s["n_prompt_tokens"])["id"]
    assert act(srv, holding, "save", "mine.bin").json()["n_saved"] >= 128
    write_like(srv, "mine.bin", "other-model.bin", fingerprint="another-model|n_ctx=1024")
    raw = bytearray((srv.saved / "mine.bin").read_bytes())
    raw[-1] ^= 1
    (srv.saved / "corrupt.bin").write_bytes(bytes(raw))
    before = slots(srv)
    for name, words in [("other-model.bin", "another model or KV layout"), ("corrupt.bin", "checksum"),
                        ("absent.bin", "no file")]:
        r = act(srv, 0, "restore", name)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert [s["n_prompt_tokens"] for s in slots(srv)] == [s["n_prompt_tokens"] for s in before]
    for slot, action, name in [(0, "save", "../escape.bin"), (0, "save", "a/b.bin"), (0, "restore", "..."),
                               (0, "save", " lead.bin"), ("x", "erase", None), (9, "erase", None),
                               (0, "open", None)]:
        r = act(srv, slot, action, name)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (slot, action, r.text)
    assert not (srv.saved.parent / "escape.bin").exists()


def test_restore_into_a_busy_slot_waits_for_its_request(srv):
    complete(srv)
    holding = max(slots(srv), key=lambda s: s["n_prompt_tokens"])["id"]
    assert act(srv, holding, "save", "waiting.bin").json()["n_saved"] >= 128
    ended: dict[str, float] = {}

    def long_request():
        requests.post(srv.url + "/completion", timeout=120, json={
            "prompt": "Count slowly:", "n_predict": 96, "temperature": 0, "ignore_eos": True})
        ended["request"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    busy = []
    while not busy and time.monotonic() < deadline:
        time.sleep(0.05)
        busy = [s["id"] for s in slots(srv) if s["is_processing"]]
    assert busy, "the request never showed as processing"
    r = act(srv, busy[0], "restore", "waiting.bin")
    answered = time.monotonic()
    t.join(120)
    assert r.status_code == 200, r.text
    assert answered >= ended["request"] - 0.5   # it waited for the request (the reply may lag its end a little)
    assert slots(srv)[busy[0]]["n_prompt_tokens"] == r.json()["n_restored"]
