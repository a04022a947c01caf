"""Several models behind one server (engine/pool.py): the embedded model loaded at start, two
tiny models from a library and a broken one from --models-dir loaded on request, through the
official `openai` client. --max-loaded 1 unloads the least recently used idle model; a model
with a stream open is never unloaded; a broken file is a 500 naming it while the others
serve; concurrent first requests load a model once; idle models unload after --idle-unload or
a request's keep_alive; POST /api/models/load and /unload."""
from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest
import requests

from appliance.library.index import Library
from appliance.models import EMBEDDED_ALIAS
from tests.engine.gguf_fixtures import write_tiny_llama

from .conftest import running_server, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("library")
    lib = Library(root)
    (root / "local").mkdir()
    for name, seed, n_ctx in (("tiny-a", 1, 512), ("tiny-b", 2, 4096)):
        path = write_tiny_llama(root / "local" / f"{name}.gguf", seed=seed, n_ctx=n_ctx)
        lib.add(name, [path], "hf:local/tiny", {"repo": "local/tiny"})
    # speculation off: no exactness probe at each load (these tests load models a dozen times);
    # one thread for the tiny ones: llama.cpp's spinning threads crawl when another process
    # holds the cores (measured: 3.8 tokens/s with 2 threads beside a busy process, 590 with 1)
    (root / "settings.toml").write_text(f'["{EMBEDDED_ALIAS}"]\nn_ctx = 1024\nn_slots = 2\nspeculate = "off"\n'
                                        '["tiny-a"]\nn_ctx = 512\nn_slots = 2\nspeculate = "off"\nn_threads = 1\n'
                                        '["tiny-b"]\nn_ctx = 4096\nn_slots = 1\nspeculate = "off"\nn_threads = 1\n')
    broken_dir = tmp_path_factory.mktemp("more")
    broken = write_tiny_llama(broken_dir / "broken.gguf", seed=3)
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) * 2 // 3])    # the header reads; the tensor data is cut short
    return root, broken_dir


def states(server) -> dict[str, dict]:
    return {m["name"]: m for m in server.health()["models"]}


@pytest.fixture(scope="module")
def one_at_a_time(library, tmp_path_factory):
    root, more = library
    with running_server(tmp_path_factory.mktemp("srv1"), "--library", str(root), "--models-dir", str(more),
                        "--max-loaded", "1") as s:
        yield s


@pytest.fixture(scope="module")
def idle_unloading(library, tmp_path_factory):
    root, _ = library
    with running_server(tmp_path_factory.mktemp("srv2"), "--library", str(root), "--idle-unload", "1.5") as s:
        yield s


def chat(server, model: str, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)


def test_every_model_is_listed_with_its_state(one_at_a_time):
    models = openai.OpenAI(base_url=one_at_a_time.url + "/v1", api_key="x").models.list().data
    by_id = {m.id: m for m in models}
    assert set(by_id) == {EMBEDDED_ALIAS, "tiny-a", "tiny-b", "broken"}
    assert by_id[EMBEDDED_ALIAS].status == {"value": "loaded"}
    st = states(one_at_a_time)
    assert st[EMBEDDED_ALIAS]["default"] and st[EMBEDDED_ALIAS]["state"] == "loaded"
    assert st["tiny-b"]["settings"] == {"n_ctx": 4096, "n_slots": 1, "speculate": "off", "n_threads": 1}
    assert st["broken"]["source"].startswith("dir:")


def test_a_request_loads_its_model_and_max_loaded_unloads_the_least_recent(one_at_a_time):
    r = chat(one_at_a_time, "tiny-a")
    assert r.model == "tiny-a" and r.choices[0].finish_reason == "length"
    st = states(one_at_a_time)
    assert st["tiny-a"]["state"] == "loaded" and st["tiny-a"]["n_ctx"] == 512
    assert wait_until(lambda: states(one_at_a_time)[EMBEDDED_ALIAS]["state"] == "unloaded")
    r = chat(one_at_a_time, "tiny-b.gguf")              # the file name answers too
    st = states(one_at_a_time)
    assert st["tiny-b"]["n_ctx"] == 4096 and st["tiny-b"]["n_slots"] == 1    # its settings.toml
    assert wait_until(lambda: states(one_at_a_time)["tiny-a"]["state"] == "unloaded")
    assert chat(one_at_a_time, EMBEDDED_ALIAS).model == EMBEDDED_ALIAS
    with pytest.raises(openai.NotFoundError, match="tiny-a, tiny-b, broken"):
        chat(one_at_a_time, "gpt-4o-mini")


def test_a_streaming_model_is_never_unloaded(one_at_a_time):
    client = openai.OpenAI(base_url=one_at_a_time.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="tiny-b", prompt="Once", max_tokens=3000, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    pieces = [next(stream)]                       # the request is decoding
    with pytest.raises(openai.APIStatusError) as e:
        chat(one_at_a_time, "tiny-a")             # room only by unloading tiny-b, which is busy
    assert e.value.status_code == 503 and "busy" in str(e.value)
    pieces += list(stream)
    assert pieces[-1].choices[0].finish_reason == "length"
    text_chunks = [p for p in pieces if p.choices and p.choices[0].text]
    assert len(text_chunks) >= 2900               # every token arrived (a few chunks carry several)
    assert chat(one_at_a_time, "tiny-a").model == "tiny-a"   # and once it finished, tiny-a loads


def test_a_broken_model_is_a_clear_error_and_the_others_serve(one_at_a_time):
    for _ in range(2):                        # the second answer comes from the remembered failure
        r = requests.post(one_at_a_time.url + "/v1/chat/completions",
                          json={"model": "broken", "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "broken" in err["message"]
    assert states(one_at_a_time)["broken"]["state"] == "failed"
    assert chat(one_at_a_time, "tiny-b").model == "tiny-b"


def test_concurrent_first_requests_load_a_model_once(one_at_a_time):
    requests.post(one_at_a_time.url + "/api/models/unload", json={"model": "tiny-a"}, timeout=60)
    before = states(one_at_a_time)["tiny-a"]["loads"]
    with cf.ThreadPoolExecutor(4) as ex:
        replies = list(ex.map(lambda _: chat(one_at_a_time, "tiny-a", max_tokens=2), range(4)))
    assert all(r.model == "tiny-a" for r in replies)
    assert states(one_at_a_time)["tiny-a"]["loads"] == before + 1


def test_a_stream_for_a_model_that_is_loading_hears_keepalives(one_at_a_time):
    requests.post(one_at_a_time.url + "/api/models/unload", json={"model": "tiny-b"}, timeout=60)
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with requests.post(one_at_a_time.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[0] == b": loading tiny-b"
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith(b"data: {")]
    assert chunks[0]["model"] == "tiny-b" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert lines[-1] == b"data: [DONE]"


def test_idle_models_unload_and_keep_alive_wins(idle_unloading):
    s = idle_unloading
    chat(s, "tiny-a")
    assert states(s)["tiny-a"]["state"] == "loaded"
    assert wait_until(lambda: states(s)["tiny-a"]["state"] == "unloaded", timeout=15)
    assert states(s)[EMBEDDED_ALIAS]["state"] == "loaded"          # the default stays
    chat(s, "tiny-b", extra_body={"keep_alive": "1h"})
    chat(s, "tiny-a", extra_body={"keep_alive": 0})
    assert wait_until(lambda: states(s)["tiny-a"]["state"] == "unloaded", timeout=15)
    assert states(s)["tiny-b"]["state"] == "loaded"                 # past --idle-unload, kept by keep_alive
    r = requests.post(s.url + "/v1/chat/completions", json={"model": "tiny-a", "keep_alive": "soon",
                                                            "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_load_and_unload_by_api(idle_unloading):
    s = idle_unloading
    r = requests.post(s.url + "/api/models/load", json={"model": "tiny-a"}, timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "loaded" and r.json()["n_ctx"] == 512
    r = requests.post(s.url + "/api/models/unload", json={"model": "tiny-b"}, timeout=60)
    assert r.json() == {"model": "tiny-b", "unloaded": True, "state": "unloaded"}
    assert requests.post(s.url + "/api/models/unload", json={"model": "tiny-b"}).json()["unloaded"] is False
    assert requests.post(s.url + "/api/models/load", json={"model": "nope"}).status_code == 404
    assert requests.post(s.url + "/api/models/load", json={}).status_code == 400
