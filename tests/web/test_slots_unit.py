"""llama-server's slot routes without a model (web/slots.py over a stub engine): the JSON shapes,
--no-slots and a missing --slot-save-path as llama-server's 501, the requests refused before the
engine is asked. The real engine answers them in test_slots_e2e.py."""
from __future__ import annotations

import pytest

from appliance.config import Config, ServerConfig
from appliance.engine.cache.slot_files import NO_SAVE_PATH
from appliance.engine.types import SamplingParams, SlotDone, Slots, SlotState
from appliance.errors import NotSupported
from web import create_app

from .test_serving_core import Pool as ServingPool


class StubEngine:
    def __init__(self, busy: bool = False, save_path: bool = True) -> None:
        self.busy, self.save_path, self.asked = busy, save_path, []

    def slots(self):
        return Slots("r", (SlotState(0, 512, False, self.busy, 40, id_task=3, params=SamplingParams(
            temperature=0, max_tokens=8), n_prompt_tokens_processed=30, n_prompt_tokens_cache=2, n_decoded=8,
            n_remain=0, has_new_line=True), SlotState(1, 512, True, self.busy, 0)))

    def slot_action(self, slot, action, filename=""):
        self.asked.append((slot, action, filename))
        if not self.save_path:
            raise NotSupported(NO_SAVE_PATH)
        return SlotDone("r", action, slot, filename, 40, 1234, 5.25)


class StubPool(ServingPool):
    """test_serving_core's one-model pool, over a stub engine of slots."""

    def __init__(self, engine: StubEngine) -> None:
        self.engine = engine


def client(tmp_path, engine: StubEngine, slots: bool = True):
    cfg = Config(server=ServerConfig(slots=slots, conversations_db=str(tmp_path / "c.db")))
    return create_app(cfg, StubPool(engine)).test_client()


def test_slots_in_llama_servers_shape(tmp_path):
    got = client(tmp_path, StubEngine()).get("/slots")
    assert got.status_code == 200
    used, fresh = got.get_json()
    assert fresh == {"id": 1, "n_ctx": 512, "speculative": True, "is_processing": False, "n_prompt_tokens": 0}
    assert used["id_task"] == 3 and used["n_prompt_tokens_cache"] == 2 and used["n_prompt_tokens_processed"] == 30
    assert used["next_token"] == [{"has_next_token": False, "has_new_line": True, "n_remain": 0, "n_decoded": 8}]
    assert used["params"]["temperature"] == 0 and used["params"]["n_predict"] == 8 and "stream" not in used["params"]


def test_no_slots_and_no_free_slot(tmp_path):
    off = client(tmp_path, StubEngine(), slots=False).get("/slots")
    assert off.status_code == 501 and off.get_json()["error"]["type"] == "not_supported_error"
    assert "--slots" in off.get_json()["error"]["message"]
    busy = client(tmp_path, StubEngine(busy=True))
    assert busy.get("/slots").status_code == 200
    assert busy.get("/slots?fail_on_no_slot=1").status_code == 503


def test_actions_answer_as_llama_server(tmp_path):
    engine = StubEngine()
    c = client(tmp_path, engine)
    saved = c.post("/slots/0?action=save", json={"filename": "a.bin"}).get_json()
    assert saved == {"id_slot": 0, "filename": "a.bin", "n_saved": 40, "n_written": 1234,
                     "timings": {"save_ms": 5.25}}
    restored = c.post("/slots/1?action=restore", json={"filename": "a.bin"}).get_json()
    assert restored == {"id_slot": 1, "filename": "a.bin", "n_restored": 40, "n_read": 1234,
                        "timings": {"restore_ms": 5.25}}
    assert c.post("/slots/0?action=erase").get_json() == {"id_slot": 0, "n_erased": 40}
    assert engine.asked == [(0, "save", "a.bin"), (1, "restore", "a.bin"), (0, "erase", "")]


@pytest.mark.parametrize("url,body,param", [
    ("/slots/abc?action=erase", None, "id_slot"), ("/slots/0?action=save", {}, "filename"),
    ("/slots/0?action=restore", {"filename": 7}, "filename"), ("/slots/0?action=erase", {"filename": []}, "filename")])
def test_requests_refused_before_the_engine(tmp_path, url, body, param):
    engine = StubEngine()
    got = client(tmp_path, engine).post(url, json=body)
    assert got.status_code == 400 and got.get_json()["error"]["param"] == param
    assert engine.asked == []


def test_no_slot_save_path_is_llama_servers_501(tmp_path):
    got = client(tmp_path, StubEngine(save_path=False)).post("/slots/0?action=erase")
    assert got.status_code == 501 and got.get_json()["error"]["message"] == NO_SAVE_PATH
