"""llama-server's own routes end to end: /completion (streamed and not, against /v1/completions),
n_predict, stop words, n_probs, token-id prompts, several prompts in one request (both routes),
grammar, /props, /apply-template, the OpenAI
routes without /v1, the context limit, /embeddings' refusals on a server with no embedding model
(its answers: test_embeddings_e2e.py, test_embeddings_chat_e2e.py), and /infill (refused by the
embedded model, which has no fill-in-the-middle tokens; laid out on a tiny model that has them)."""
from __future__ import annotations

import json
import math

import openai
import pytest
import requests

from ..engine.gguf_fixtures import write_tiny_llama
from .conftest import SHARED, running_server

N_CTX, SLOTS = 1024, 2          # the shared server's (conftest.SHARED)
PROMPT = "The three primary colours are"
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*SHARED)


def post(server, path: str, body: dict, status: int = 200) -> dict:
    r = requests.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def streamed(server, path: str, body: dict) -> list[dict]:
    with requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]


def test_completion_streamed_and_not_is_the_v1_completion(server):
    body = {"prompt": PROMPT, "n_predict": 12, **GREEDY}
    whole = post(server, "/completion", body)
    chunks = streamed(server, "/completion", body)
    last = chunks[-1]
    assert all(not c["stop"] for c in chunks[:-1]) and last["stop"] and last["content"] == ""
    assert "".join(c["content"] for c in chunks) == whole["content"]
    v1 = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, **GREEDY})
    assert whole["content"] == v1["choices"][0]["text"]
    assert whole["tokens_evaluated"] == last["tokens_evaluated"] == v1["usage"]["prompt_tokens"]
    assert whole["tokens_predicted"] == last["tokens_predicted"] == v1["usage"]["completion_tokens"] <= 12
    assert whole["stop_type"] == ("limit" if whole["tokens_predicted"] == 12 else "eos")
    for key in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "predicted_n", "predicted_per_second"):
        assert key in whole["timings"]
    assert whole["generation_settings"]["n_predict"] == 12 and whole["truncated"] is False


def test_n_predict_stop_words_and_n_probs(server):
    body = {"prompt": PROMPT, "n_predict": 12, **GREEDY}
    whole = post(server, "/completion", body)["content"]
    short = post(server, "/completion", {**body, "n_predict": 3})
    assert short["tokens_predicted"] == 3 and short["stop_type"] == "limit" and whole.startswith(short["content"])
    word = whole.split()[1]
    stopped = post(server, "/completion", {**body, "stop": [word]})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert word not in stopped["content"] and whole.startswith(stopped["content"])
    probs = post(server, "/completion", {**body, "n_probs": 3, "return_tokens": True})
    assert probs["content"] == whole
    assert [p["id"] for p in probs["completion_probabilities"]] == probs["tokens"]
    for p in probs["completion_probabilities"]:
        top = p["top_logprobs"]
        assert len(top) == 3 and sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-6
        assert top[0]["id"] == p["id"] and top[0]["logprob"] == pytest.approx(p["logprob"])


def test_a_prompt_of_token_ids_or_mixed_is_the_same_prompt_as_its_text(server):
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
    head = post(server, "/tokenize", {"content": "The three", "add_special": True})["tokens"]
    body = {"n_predict": 6, **GREEDY}
    text = post(server, "/completion", {**body, "prompt": PROMPT})
    for prompt in (ids, [*head, " primary colours are"]):
        got = post(server, "/completion", {**body, "prompt": prompt})
        assert (got["content"], got["tokens_evaluated"]) == (text["content"], len(ids))
        assert got["prompt"] == PROMPT


def test_several_prompts_give_each_prompts_own_reply(server):
    """A batch through the real engine: each prompt's reply is the one it gets alone (greedy), on
    /v1/completions (the openai client: a choice per prompt, index prompt * n + choice) and on
    /completion (an array of results); a token id outside the vocabulary refuses the batch,
    naming the prompt."""
    ids = post(server, "/tokenize", {"content": "Rivers of Europe:", "add_special": True})["tokens"]
    batch = [PROMPT, "Once upon a time", ids]
    alone = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 8, **GREEDY})["choices"][0]["text"]
             for p in batch]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="any", prompt=batch, max_tokens=8, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices][::2] == alone          # choice 0 of each prompt: its greedy reply
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="any", prompt=batch, max_tokens=8, stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == alone
    got = post(server, "/completion", {"prompt": batch, "n_predict": 8, **GREEDY})
    assert [(g["index"], g["content"]) for g in got] == list(enumerate(alone)) and got[2]["tokens_evaluated"] == len(ids)
    err = post(server, "/v1/completions", {"prompt": [PROMPT, [1, 10**9]], "max_tokens": 4}, status=400)["error"]
    assert err["param"] == "prompt[1]" and err["message"].startswith("prompt[1]: ") and "10" in err["message"]


def test_n_predict_zero_only_evaluates_and_a_grammar_constrains(server):
    cached = post(server, "/completion", {"prompt": PROMPT, "n_predict": 0})
    assert cached["content"] == "" and cached["tokens_predicted"] == 0 and cached["tokens_evaluated"] > 0
    answer = post(server, "/completion", {"prompt": "Is the sky blue? Answer:", "n_predict": 4,
                                           "grammar": 'root ::= " yes" | " no"', **GREEDY})
    assert answer["content"] in (" yes", " no")
    # the same grammar, and a top-level json_schema, on chat: llama-server takes both there too
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "grammar": 'root ::= "yes" | "no"',
                                                 **GREEDY})
    assert chat["choices"][0]["message"]["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"],
              "additionalProperties": False}
    out = post(server, "/chat/completions", {"messages": msgs, "max_tokens": 64, "json_schema": schema, **GREEDY})
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["blue"], bool)


def test_props_reports_the_servers_context_and_slots(server):
    props = requests.get(server.url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["total_slots"] == SLOTS
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["model_path"].endswith(".gguf") and "im_start" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False, "video": False}


def test_apply_template_is_the_chat_requests_prompt(server):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}
    prompt = post(server, "/apply-template", chat)["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Be brief." in prompt
    ids = post(server, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    used = post(server, "/v1/chat/completions", {**chat, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert len(ids) == used


def test_openai_routes_answer_without_v1(server):
    assert requests.get(server.url + "/models", timeout=30).json() == \
        requests.get(server.url + "/v1/models", timeout=30).json()
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, **GREEDY}
    bare = post(server, "/chat/completions", chat)["choices"][0]["message"]["content"]
    assert bare == post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    # llama-server's /completions is its own /completion, not OpenAI's
    assert post(server, "/completions", {"prompt": PROMPT, "n_predict": 2})["stop"] is True


def test_bad_input_and_an_overlong_prompt_are_400s_before_any_stream_byte(server):
    for body, param in (({"prompt": PROMPT, "n_predict": "x"}, "n_predict"),
                        ({"prompt": PROMPT, "mirostat": 3}, "mirostat"), ({"prompt": []}, "prompt")):
        assert post(server, "/completion", body, status=400)["error"]["param"] == param
    r = requests.post(server.url + "/completion", json={"prompt": "word " * (N_CTX + 10), "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["n_ctx"] == N_CTX
    assert r.json()["error"]["type"] == "exceed_context_size_error"     # llama-server's, on its routes


def test_embeddings_without_an_embedding_model_are_refused_in_words(server):
    for path in ("/embeddings", "/embedding"):
        assert post(server, path, {"content": "hello"}, status=400)["error"]["message"] == (
            "this server serves no embedding model: start it with --embedding-model PATH.gguf (an embedding model) "
            "or --embedding-model chat (the chat model's mean-pooled hidden state)")
    assert post(server, "/embeddings", {"prompt": "hello"}, status=400)["error"]["message"] == \
        '"input" or "content" must be provided'
    err = post(server, "/embeddings", {"input": "hello", "embd_normalize": "2"}, status=400)["error"]
    assert err["param"] == "embd_normalize" and err["message"] == ("'embd_normalize' must be an integer: -1 (none), "
                                                                   "0 (max absolute, scaled to int16), 1 (taxicab), "
                                                                   "2 (Euclidean) or p > 2 (p-norm)")


def test_infill_on_a_model_without_fim_tokens_is_refused(server):
    err = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": ")"}, status=400)["error"]
    assert "fill-in-the-middle" in err["message"]


# a tiny model with SmolLM2's vocabulary, told which of its special tokens are the FIM ones
FIM = {"fim_pre": 6, "fim_suf": 7, "fim_mid": 8, "fim_sep": 5}    # <reponame> (4) is found by llama.cpp


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-fim.gguf", special_ids=FIM)
    with running_server(tmp_path_factory.mktemp("fim"), "--model", str(model), "--n-ctx", "256", "--n-slots", "1",
                        "--speculate", "off") as srv:
        yield srv


def test_infill_lays_out_the_prompt_with_the_models_fim_tokens(fim_server):
    body = {"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x", "n_predict": 4, **GREEDY,
            "input_extra": [{"filename": "a.py", "text": "A = 1\n"}]}
    got = post(fim_server, "/infill", body)
    assert got["prompt"] == ("<reponame>myproject\n<file_sep>a.py\nA = 1\n<file_sep>filename\n"
                             "<filename>def f(x<gh_stars>):\n<issue_start>")
    ids = post(fim_server, "/tokenize", {"content": got["prompt"]})["tokens"]
    assert got["tokens_evaluated"] == len(ids) and ids[-1] == FIM["fim_mid"]
    assert "".join(c["content"] for c in streamed(fim_server, "/infill", body)) == got["content"]


def test_return_progress_streams_the_prompts_processing_before_the_reply(server):
    """llama-server's prompt_progress: a chunk as the prefill starts and one after each prompt
    chunk, `processed` rising to `total`, all before the first token; on /completion and on the
    OpenAI chat stream alike, the reply the same as without them."""
    body = {"prompt": "one two three four five six " * 100, "n_predict": 4, "cache_prompt": False, **GREEDY}
    plain = streamed(server, "/completion", body)
    chunks = streamed(server, "/completion", {**body, "return_progress": True})
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    first_text = next(i for i, c in enumerate(chunks) if c.get("content"))
    assert len(progress) >= 3 and all("prompt_progress" not in c for c in chunks[first_text:])
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    assert progress[0]["processed"] == progress[0]["cache"] == 0 and progress[-1]["processed"] == progress[-1]["total"]
    assert progress[-1]["total"] == chunks[-1]["tokens_evaluated"] and progress[-1]["time_ms"] > 0
    assert "".join(c["content"] for c in chunks) == "".join(c["content"] for c in plain)
    chat = streamed(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": body["prompt"]}],
                                                     "max_tokens": 4, "return_progress": True, "cache_prompt": False,
                                                     **GREEDY})
    marks = [c for c in chat if "prompt_progress" in c]
    assert len(marks) >= 3 and marks[-1]["prompt_progress"]["processed"] == marks[-1]["prompt_progress"]["total"]
    assert all(c["object"] == "chat.completion.chunk" and c["choices"][0]["delta"] == {} for c in marks)


def test_timings_per_token_puts_the_timings_so_far_on_every_token(server):
    body = {"prompt": PROMPT, "n_predict": 6, **GREEDY}
    chunks = [c for c in streamed(server, "/completion", {**body, "timings_per_token": True}) if not c["stop"]]
    assert chunks and all("timings" in c for c in chunks)
    assert [c["timings"]["predicted_n"] for c in chunks] == sorted(c["timings"]["predicted_n"] for c in chunks)
    assert all(c["timings"]["prompt_n"] + c["timings"]["cache_n"] == chunks[0]["tokens_evaluated"] for c in chunks)
    assert all("timings" not in c for c in streamed(server, "/completion", body)[:-1])   # only when asked
    chat = streamed(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                     "max_tokens": 4, "timings_per_token": True, **GREEDY})
    texts = [c for c in chat if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert texts and all("prompt_ms" in c["timings"] for c in texts)


def test_post_sampling_probs_are_the_distribution_drawn_from(server):
    """n_probs with post_sampling_probs: `prob` and `top_probs` after the chain (top_k 2 leaves two
    candidates, their probabilities summing to 1; greedy leaves one, with probability 1)."""
    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 5, "post_sampling_probs": True, "seed": 3}
    for probs in (post(server, "/completion", {**body, "top_k": 2, "temperature": 1.0})["completion_probabilities"],
                  [c["completion_probabilities"][0] for c in streamed(server, "/completion",
                                                                      {**body, "top_k": 2, "temperature": 1.0})
                   if c.get("completion_probabilities")]):
        assert probs and all(1 <= len(p["top_probs"]) <= 2 and "logprob" not in p for p in probs)
        assert all(abs(sum(t["prob"] for t in p["top_probs"]) - 1.0) < 1e-5 for p in probs)
        assert all(p["prob"] in [t["prob"] for t in p["top_probs"]] for p in probs)
    greedy = post(server, "/completion", {**body, "temperature": 0})["completion_probabilities"]
    assert all(p["prob"] == 1.0 and [t["prob"] for t in p["top_probs"]] == [1.0] for p in greedy)
    raw = post(server, "/completion", {**body, "temperature": 0, "post_sampling_probs": False})
    assert all(len(p["top_logprobs"]) == 5 for p in raw["completion_probabilities"])
