"""Chat jobs over Flask's test client and the scripted engine: a reply the server writes into the
conversation and streams to any subscriber from any offset, one job a conversation at a time,
stop, a restart's cut-off, the tool loop with approve / approve always / deny / a hung tool /
the step limit, and the routes' refusals."""
from __future__ import annotations

import json
import time

import pytest

from appliance.chat_jobs import ChatJobStore
from appliance.config import Config, ServerConfig
from appliance.conversations import ConversationStore
from web import create_app

from .fake_tools import REPLY, SEEN, FakeHub, director
from .scripted_engine import ScriptedEngine, ScriptedPool, model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return ScriptedEngine(model("Qwen3-Coder", str(tmp_path_factory.mktemp("jobs-model"))), director=director)


def make_app(engine, db, hub=None, **server):
    app = create_app(Config(server=ServerConfig(conversations_db=str(db), **server)), ScriptedPool(engine))
    if hub is not None:
        app.extensions["appliance.tools"] = hub
    return app


@pytest.fixture
def hub():
    hub = FakeHub(timeout_s=0.5)
    yield hub
    hub.release.set()


@pytest.fixture
def client(engine, tmp_path, hub):
    return make_app(engine, tmp_path / "c.db", hub).test_client()


def ok(resp, status=200):
    assert resp.status_code == status, resp.get_data(as_text=True)
    return resp.get_json()


def conversation(client, settings=None, text="What is the capital of France?") -> str:
    conv = ok(client.post("/api/conversations", json={"messages": [{"role": "user", "content": text}]}), 201)
    if settings:   # tools are the MCP layer's setting: written to the store as its panel will
        store = client.application.extensions["appliance.conversations"].get()
        store.update(conv["id"], settings=settings)
    return conv["id"]


def start(client, conv_id, position=1, status=201, **extra):
    body = {"request": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                        "max_tokens": 64, "temperature": 0, **extra.pop("request", {})},
            "position": position, **extra}
    return ok(client.post(f"/api/conversations/{conv_id}/jobs", json=body), status)


def events(client, job_id, offset=0) -> list[dict]:
    """The job's events from `offset` to its end (the stream ends when the job does)."""
    text = client.get(f"/api/jobs/{job_id}/events?from={offset}").get_data(as_text=True)
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def until(client, job_id, state, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = ok(client.get(f"/api/jobs/{job_id}"))
        if job["state"] == state:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


def messages(client, conv_id) -> list[dict]:
    return ok(client.get(f"/api/conversations/{conv_id}"))["messages"]


def test_a_job_writes_its_reply_and_streams_it_from_any_offset(client):
    conv_id = conversation(client)
    job = start(client, conv_id)
    assert job["state"] == "running" and job["position"] == 1 and job["id"].startswith("job_")
    evs = events(client, job["id"])
    assert [e["seq"] for e in evs] == list(range(len(evs)))
    assert evs[0]["type"] == "message" and evs[0]["position"] == 1 and evs[-1]["type"] == "end"
    text = "".join(e["chunk"]["choices"][0]["delta"].get("content", "") for e in evs
                   if e["type"] == "chunk" and e["chunk"]["choices"])
    assert text == REPLY and evs[-1]["job"]["state"] == "done"
    assert any(e["type"] == "chunk" and "timings" in e["chunk"] for e in evs)
    assert any(e["type"] == "chunk" and "usage" in e["chunk"] for e in evs)
    assert events(client, job["id"], 3) == evs[3:]     # a late subscriber from an offset
    stored = messages(client, conv_id)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["content"] == REPLY and stored[1]["finish_reason"] == "stop"
    assert stored[1]["timings"]["predicted_n"] > 0 and "ttft_ms" in stored[1]["timings"]
    assert ok(client.get(f"/api/conversations/{conv_id}/job"))["id"] == job["id"]
    # a continue job grows the message at its position
    job = start(client, conv_id, 1, **{"continue": True})
    assert events(client, job["id"])[0]["message"]["content"] == REPLY
    assert messages(client, conv_id)[1]["content"] == REPLY + REPLY


def test_one_job_a_conversation_and_stop(client):
    conv_id = conversation(client, {"tools": ["hang"]})
    job = start(client, conv_id)
    until(client, job["id"], "waiting")                 # a call waits for the person: the job is live
    err = ok(client.post(f"/api/conversations/{conv_id}/jobs", json={
        "request": {"messages": []}, "position": 1}), 409)["error"]
    assert err["code"] == "conflict" and job["id"] in err["message"]
    ok(client.post(f"/api/jobs/{job['id']}/stop"))
    assert until(client, job["id"], "stopped")["pending"][0]["name"] == "hang"
    assert events(client, job["id"])[-1]["job"]["state"] == "stopped"
    job = start(client, conv_id)                         # a new job may start once it ended
    until(client, job["id"], "waiting")
    ok(client.post(f"/api/jobs/{job['id']}/stop"))


def test_approve_runs_the_call_and_the_model_answers_from_its_result(client, hub):
    conv_id = conversation(client, {"tools": ["add"]})
    job = start(client, conv_id)
    waiting = until(client, job["id"], "waiting")
    (call,) = waiting["pending"]
    assert (call["name"], json.loads(call["arguments"]), call["decision"]) == ("add", {"a": 2, "b": 3}, None)
    assert not hub.calls                                  # nothing runs before the decision
    ok(client.post(f"/api/jobs/{job['id']}/calls/{call['id']}", json={"decision": "approve"}))
    evs = events(client, job["id"])
    assert evs[-1]["job"]["state"] == "done" and evs[-1]["job"]["steps"] == 1
    stored = messages(client, conv_id)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["function"]["name"] == "add" and stored[1]["finish_reason"] == "tool_calls"
    assert (stored[2]["content"], stored[2]["tool_call_id"]) == ("5", call["id"])
    assert stored[3]["content"] == "Result: 5" and hub.calls == [("add", {"a": 2, "b": 3})]
    assert [e["position"] for e in evs if e["type"] == "message"] == [1, 2, 3]


def decided(client, tool: str, decision: str) -> tuple[str, dict]:
    """A conversation with `tool`, a turn whose call gets `decision`; its id and the ended job."""
    conv_id = conversation(client, {"tools": [tool]})
    job = start(client, conv_id)
    call = until(client, job["id"], "waiting")["pending"][0]
    ok(client.post(f"/api/jobs/{job['id']}/calls/{call['id']}", json={"decision": decision}))
    return conv_id, until(client, job["id"], "done")


def test_deny_and_a_hung_tool_send_their_reason_to_the_model(client, hub):
    conv_id, _ = decided(client, "add", "deny")
    assert messages(client, conv_id)[2]["content"] == "denied by the user" and not hub.calls
    conv_id, done = decided(client, "hang", "approve")
    assert messages(client, conv_id)[2]["content"] == "error: timed out after 0.5 s"
    assert done["pending"] == [] and events(client, done["id"])[-1]["job"]["state"] == "done"


def test_approve_always_is_remembered_and_auto_approved_tools_run_unasked(client, hub):
    conv_id, _ = decided(client, "add", "always")
    assert ok(client.get(f"/api/conversations/{conv_id}"))["settings"]["tools_approved"] == ["add"]
    job = start(client, conv_id, 4)                      # the next turn's call runs unasked
    evs = events(client, job["id"])
    assert not [e for e in evs if e["type"] == "state" and e["job"]["state"] == "waiting"]
    assert messages(client, conv_id)[5]["content"] == "5" and len(hub.calls) == 2
    conv_id = conversation(client, {"tools": ["clock"]})   # the owner's auto_approve
    job = start(client, conv_id)
    assert events(client, job["id"])[-1]["job"]["state"] == "done"
    assert messages(client, conv_id)[2]["content"] == "12:00"


def test_the_step_limit_ends_the_job_and_says_so(engine, tmp_path, hub):
    client = make_app(engine, tmp_path / "steps.db", hub, tool_steps=0).test_client()
    conv_id = conversation(client, {"tools": ["clock"]})
    job = start(client, conv_id)
    end = events(client, job["id"])[-1]["job"]
    assert end["state"] == "done" and "step limit" in end["error"] and not hub.calls
    assert [m["role"] for m in messages(client, conv_id)] == ["user", "assistant"]


def test_a_forced_tool_choice_is_the_first_replys_only(client, hub):
    conv_id = conversation(client, {"tools": ["clock", "add"]})
    SEEN.clear()
    job = start(client, conv_id, request={"tool_choice": {"type": "function", "function": {"name": "clock"}}})
    assert events(client, job["id"])[-1]["job"]["state"] == "done"
    assert hub.calls == [("clock", {})]
    assert [r.tool_choice for r in SEEN] == ["clock", "auto"]
    assert [t.name for t in SEEN[0].tools] == ["clock", "add"]


def test_a_restart_marks_the_running_job_cut_off_and_keeps_its_partial_reply(engine, tmp_path):
    db = tmp_path / "restart.db"
    convs = ConversationStore.open(db)
    conv = convs.create("t", {}, [{"role": "user", "content": "hi"}])
    job = ChatJobStore.open(convs).create(conv["id"], 1)       # what a killed server left
    convs.upsert_message(conv["id"], 1, {"role": "assistant", "content": "Half a rep"})
    client = make_app(engine, db).test_client()
    after = ok(client.get(f"/api/conversations/{conv['id']}/job"))
    assert (after["id"], after["state"]) == (job["id"], "cut_off")
    stored = messages(client, conv["id"])[1]
    assert (stored["content"], stored["finish_reason"]) == ("Half a rep", "cut_off")
    evs = events(client, job["id"])                            # its events are gone: its end
    assert [(e["type"], e["job"]["state"]) for e in evs] == [("end", "cut_off")]
    start(client, conv["id"], 1)                               # no longer blocks a new job


def test_bad_starts_are_refused_and_leave_no_job(client):
    conv_id = conversation(client)
    url = f"/api/conversations/{conv_id}/jobs"
    for body, param in [({"request": {"messages": []}, "position": 5}, "position"),
                        ({"request": {"messages": [], "tools": []}, "position": 1}, "request.tools"),
                        ({"request": {"messages": []}, "position": 1, "extra": 1}, "extra"),
                        ({"request": [], "position": 1}, "request"),
                        ({"request": {"messages": []}, "position": 1, "continue": True}, "position")]:
        assert ok(client.post(url, json=body), 400)["error"]["param"] == param
    over = {"request": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "position": 1}
    assert client.post(url, json=over).status_code == 400
    assert ok(client.get(f"/api/conversations/{conv_id}/job")) is None
    assert client.post("/api/conversations/conv_missing/jobs", json=over).status_code == 404
    assert client.get("/api/jobs/job_missing").status_code == 404


def test_job_routes_need_the_api_key(engine, tmp_path):
    client = make_app(engine, tmp_path / "key.db", api_key="k").test_client()
    assert client.get("/api/jobs/job_x").status_code == 401
    assert client.post("/api/conversations/conv_x/jobs", json={}).status_code == 401
    key = {"Authorization": "Bearer k"}
    assert client.get("/api/jobs/job_x", headers=key).status_code == 404
