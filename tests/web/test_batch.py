"""Several prompts in one completions request (web/prompts.py, web/batch.py): which lists are
one prompt and which several (llama-server's rule), the batch's events merged as one request's
(choice j of prompt i is index i * n + j, usage summed, a refused prompt refusing the batch and
naming it), and the answers of /v1/completions (through the official `openai` client) and
llama-server's /completion (an array of results) over a scripted engine. The same through the
real engine: test_llamaserver_e2e.py."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from appliance.config import Config, ServerConfig
from appliance.engine.types import Accepted, ChoiceEnd, Delta, Done, Error, Request, Timings, Usage
from appliance.errors import ContextOverflow, InvalidRequest
from web import create_app, prompts
from web.batch import Merged

from .test_serving_core import MODEL, WORDS, Pool

REPLY = "".join(WORDS)


@pytest.mark.parametrize("value,got", [
    ("hi", [("hi", None)]), ([1, 2], [(None, (1, 2))]), (["hi"], [("hi", None)]), ([[1, 2]], [(None, (1, 2))]),
    (["a", "b"], [("a", None), ("b", None)]), ([[1], [2, 3]], [(None, (1,)), (None, (2, 3))]),
    (["a", [7]], [("a", None), (None, (7,))])])
def test_a_list_with_no_number_in_it_holds_a_prompt_per_element(value, got):
    assert [(p.text, p.ids) for p in prompts.read_all(value)] == got


@pytest.mark.parametrize("value,param", [
    (None, "prompt"), ([], "prompt"), ([[]], "prompt"), (["a", []], "prompt[1]"), ([[1], "a", 5.5], "prompt[2]"),
    ([[1], [True]], "prompt[1]"), (["a", {"x": 1}], "prompt[1]"), (["a"] * (prompts.MAX_PROMPTS + 1), "prompt")])
def test_bad_prompts_are_refused_naming_the_one_at_fault(value, param):
    with pytest.raises(InvalidRequest) as e:
        prompts.read_all(value)
    assert e.value.param == param, e.value.message


class _Stream:
    def __init__(self, request_id: str, aborted: list[str]) -> None:
        self.id, self.finished, self.aborted = request_id, False, aborted

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.aborted.append(self.id)


class _Engine:
    """Submits nothing: the test puts each request's events on the batch's queue itself."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def submit(self, request: Request, events) -> _Stream:
        return _Stream(request.id, self.aborted)


def _batch(n: int = 1, prompts_: int = 2) -> tuple[Merged, _Engine]:
    engine = _Engine()
    requests = [Request(id=f"b-{i}", prompt="x", n=n) for i in range(prompts_)]
    return Merged.submit(engine, requests, "b", n), engine


def _drain(merged: Merged) -> list:
    got = []
    while not got or not isinstance(got[-1], Done):
        got.append(merged.get(timeout=1))
    return got


def test_a_batch_is_one_request_whose_choices_are_numbered_prompt_by_prompt():
    merged, _ = _batch(n=2)
    timings = Timings(5, 1, 10.0, 3, 30.0, 1.0, 64)
    for ev in (Accepted("b-0", 5, 1), Delta("b-0", "x", (1,), index=1),          # before the batch is accepted
               Accepted("b-1", 6, 0), Delta("b-1", "y", (2,), index=0),
               Done("b-1", "length", Usage(6, 4), timings, choices=(ChoiceEnd(0, "length"), ChoiceEnd(1, "stop"))),
               Done("b-0", "stop", Usage(5, 2, 1), timings, choices=(ChoiceEnd(0, "stop"), ChoiceEnd(1, "stop")))):
        merged.events.put(ev)
    accepted, *deltas, done = _drain(merged)
    assert accepted == Accepted("b", 11, 1)
    assert [(d.request_id, d.index, d.text) for d in deltas] == [("b", 1, "x"), ("b", 2, "y")]
    assert [(e.index, e.finish_reason) for e in done.ends()] == [(0, "stop"), (1, "stop"), (2, "length"), (3, "stop")]
    assert done.usage == Usage(11, 6, 1) and done.request_id == "b"
    assert (done.timings.prompt_n, done.timings.predicted_n, done.timings.predicted_ms) == (10, 6, 30.0)
    assert [d.request_id for d in merged.parts] == ["b-0", "b-1"]


def test_a_refused_prompt_refuses_the_batch_naming_it_and_the_others_are_aborted():
    merged, engine = _batch(prompts_=3)
    merged.events.put(Accepted("b-0", 5))
    merged.events.put(Error("b-1", *ContextOverflow("the prompt alone is 9 tokens", n_prompt_tokens=9, n_ctx=8).to_wire()))
    with pytest.raises(ContextOverflow) as e:
        _drain(merged)
    assert e.value.message == "prompt[1]: the prompt alone is 9 tokens" and e.value.param == "prompt[1]"
    assert e.value.fields == {"n_prompt_tokens": 9, "n_ctx": 8}
    assert engine.aborted == ["b-0", "b-2"]        # the refused one has ended already


@pytest.fixture
def app(tmp_path):
    return create_app(Config(server=ServerConfig(conversations_db=str(tmp_path / "c.db"))), Pool())


@pytest.fixture
def client(app):
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost")
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)


def test_the_openai_client_gets_a_choice_per_prompt_and_choice(client, app):
    r = client.completions.create(model=MODEL, prompt=["one", "two", "three"], n=2, max_tokens=8)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [REPLY, REPLY + "1"] * 3           # prompt i's choice j at i * 2 + j
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3 * 7, 3 * 2 * len(WORDS))
    sent = app.extensions["appliance"].pool.engine.requests
    assert [(q.prompt, q.prompt_ids, q.n) for q in sent] == [("one", None, 2), ("two", None, 2), ("three", None, 2)]
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=[[1, 2], [3]], stream=True, max_tokens=8,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: REPLY, 1: REPLY} and chunk.usage.prompt_tokens == 14
    assert [q.prompt_ids for q in sent[3:]] == [(1, 2), (3,)]


def test_a_refused_prompt_is_a_400_naming_it(client, app):
    engine = app.extensions["appliance"].pool.engine
    engine.refuse = ContextOverflow("too long", n_prompt_tokens=9, n_ctx=8)
    engine.refused = lambda request: request.prompt == "long"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["short", "long"], max_tokens=8)
    assert e.value.body["param"] == "prompt[1]" and e.value.body["message"] == "prompt[1]: too long"
    assert client.completions.create(model=MODEL, prompt=["short"], max_tokens=8).choices[0].text == REPLY


def test_llama_servers_completion_answers_an_array_of_results(app):
    web = app.test_client()
    got = web.post("/completion", json={"prompt": ["one", [5, 6], ["mixed", 7]]}).get_json()
    assert [(r["index"], r["content"], r["tokens_evaluated"]) for r in got] == [(i, REPLY, 7) for i in range(3)]
    assert [r["prompt"] for r in got] == ["one", "\x05\x06", "mixed\x07"]
    assert isinstance(web.post("/completion", json={"prompt": ["one"]}).get_json(), dict)
    lines = [json.loads(line[6:]) for line in web.post("/completion", json={"prompt": ["a", "b"], "stream": True})
             .get_data(as_text=True).splitlines() if line.startswith("data: ")]
    for i in (0, 1):
        mine = [c for c in lines if c["index"] == i]
        assert "".join(c["content"] for c in mine) == REPLY and [c["stop"] for c in mine][-1] is True
        assert mine[-2]["tokens_predicted"] == len(WORDS)
    r = web.post("/completion", json={"prompt": ["a", []]})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "prompt[1]"
