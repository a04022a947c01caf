"""llama-server's /completion and /infill without a server: the translation onto the OpenAI
completions request (through wire's own validation), the refusals, /infill's token layout
over a fake vocabulary, and the model's names (--model-alias a,b, --tags) in /v1/models."""
from __future__ import annotations

import math

import pytest

from appliance import config
from appliance.engine.pool import ModelPool
from appliance.engine.runners.base import FimTokens
from appliance.engine.types import Done, Timings, Usage
from appliance.errors import InvalidRequest
from appliance.library.catalog import catalog
from tests.engine.gguf_fixtures import write_tiny_llama
from web import create_app
from web import llamaserver as ls
from web import wire
from web.infill import SNIPPET, Infill

N_CTX = 1024


def request(body: dict, prompt="Once upon a time"):
    """The engine request a /completion body becomes."""
    body = {"model": "m", **body}
    native = ls.Native.read(body, N_CTX)
    parsed = wire.parse_completion(ls.openai_body(body, prompt), "r", {"m"}, N_CTX)
    return native.adjust(parsed.request)


def refused(param: str, fn, *args) -> None:
    with pytest.raises(InvalidRequest) as e:
        fn(*args)
    assert e.value.param == param, e.value.message


def test_absent_sampling_fields_take_llama_servers_defaults_and_n_predict_minus_one_is_unbounded():
    p = request({}).params
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert p.max_tokens is None and p.seed is None and not p.logprobs


def test_fields_map_onto_the_openai_request():
    req = request({"n_predict": 7, "temperature": -1, "top_k": 3, "seed": 42, "stop": ["\n\n"], "n_probs": 12,
                   "repeat_penalty": 1.1, "cache_prompt": False, "n_indent": 4, "samplers": ["top_k"]},
                  prompt=[1, 2, 3])
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop) == (7, 0.0, 3, 42, ("\n\n",))
    assert p.logprobs and p.top_logprobs == 12 and p.repetition_penalty == 1.1
    assert req.prompt_ids == (1, 2, 3) and req.cache_prompt is False


def test_random_seeds_n_predict_zero_grammar_and_json_schema():
    assert request({"seed": -1}).params.seed is None and request({"seed": ls.RANDOM_SEED}).params.seed is None
    assert request({"n_predict": 0}).params.max_tokens == 1     # the prompt is run; the reply is not answered
    assert request({"grammar": 'root ::= "a"'}).constraint.kind == "gbnf"
    assert request({"json_schema": {"type": "object"}}).constraint.kind == "json_schema"


@pytest.mark.parametrize("body,param", [
    ({"n_predict": -2}, "n_predict"), ({"n_predict": N_CTX + 1}, "n_predict"), ({"n_probs": 21}, "n_probs"),
    ({"return_tokens": 1}, "return_tokens"), ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
    ({"response_fields": "content"}, "response_fields"), ({"mirostat": 3}, "mirostat"),
    ({"samplers": "kz"}, "samplers"), ({"dry_base": 0.5}, "dry_base"), ({"dry_sequence_breakers": [""]},
                                                                          "dry_sequence_breakers"),
    ({"logit_bias": [15, -1]}, "logit_bias"), ({"temperature": 3}, "temperature"), ({"top_p": 2}, "top_p"),
    ({"stop": [1]}, "stop"), ({"json_schema": "x"}, "json_schema")])
def test_bad_fields_are_refused_naming_them(body, param):
    refused(param, request, body)


def test_logit_bias_takes_llama_servers_forms():
    texts = {"Hello": [9906], " world": [1917, 1918]}
    tokenize = lambda xs: [texts[x] for x in xs]  # noqa: E731
    bias = ls.logit_bias([[15, -1], ["Hello", 2.5], [16, False], [" world", -100]], tokenize)
    assert bias == ((15, -1.0), (9906, 2.5), (16, float("-inf")), (1917, -100.0), (1918, -100.0))
    assert ls.logit_bias({"15": 3, "Hello": False}, tokenize) == ((15, 3.0), (9906, float("-inf")))
    assert request({"logit_bias": [[15, -1]]}).params.logit_bias == ((15, -1.0),)   # ids need no tokenizer


@pytest.mark.parametrize("value,message", [
    ("x", "'logit_bias' must be [[token id or text, bias], ...] or {\"token id or text\": bias}"),
    ([[15]], "logit_bias entries must be [token id or text, bias] pairs; got [15]"),
    ([[15, True]], "a logit_bias bias must be a number, or false to ban the token; got True"),
    ([[15, "1"]], "a logit_bias bias must be a number, or false to ban the token; got '1'"),
    ([[-2, 1]], "a logit_bias token must be a token id or a text; got -2"),
    ([[1.5, 1]], "a logit_bias token must be a token id or a text; got 1.5"),
])
def test_bad_logit_bias_is_refused_word_for_word(value, message):
    with pytest.raises(InvalidRequest) as e:
        ls.logit_bias(value, None)
    assert (e.value.param, e.value.message) == ("logit_bias", message)


def test_unsupported_options_are_refused_word_for_word():
    with pytest.raises(InvalidRequest) as e:
        request({"n_cmpl": 2})
    assert e.value.message == "'n_cmpl' (several completions) is not supported by this server"


def test_llama_servers_samplers_reach_the_engine():
    p = request({"mirostat": 2, "mirostat_tau": 4.0, "typical_p": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.2,
                 "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "top_n_sigma": 1.5, "dynatemp_range": 0.3,
                 "repeat_last_n": 16, "samplers": ["top_k", "Typical-P", "temperature"]}).params
    assert (p.mirostat, p.mirostat_tau, p.typical_p, p.xtc_probability, p.xtc_threshold, p.dry_multiplier,
            p.dry_sequence_breakers, p.top_n_sigma, p.dynatemp_range, p.penalty_last_n) == \
        (2, 4.0, 0.9, 0.5, 0.2, 0.8, ("\n",), 1.5, 0.3, 16)
    assert p.samplers == ("top_k", "typ_p", "temperature")
    assert request({"samplers": "kt"}).params.samplers == ("top_k", "temperature")      # letters
    assert request({"samplers": "top_k;min_p"}).params.samplers == ("top_k", "min_p")   # names in a string


def test_neutral_values_of_unsupported_options_are_accepted():
    assert request({"lora": [], "n_cmpl": 1}).params.temperature == 0.8
    assert request({"n_probs": 2, "post_sampling_probs": True}).params.post_sampling_probs


@pytest.mark.parametrize("value,prompts", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), ([5, "a", 6], [[5, "a", 6]]), (["hi"], ["hi"]), ([[1, 2]], [[1, 2]]),
    ({"prompt_string": "x"}, [{"prompt_string": "x"}]),     # multimodal: prompts.py reads it
    (["a", [1, "b"], [2]], ["a", [1, "b"], [2]])])            # no number in the list: a prompt each
def test_prompt_shapes(value, prompts):
    assert ls.read_prompts(value) == prompts


@pytest.mark.parametrize("value,param", [(None, "prompt"), ([], "prompt"), ([True], "prompt"), ([1.5], "prompt"),
                                         (["a", []], "prompt[1]"), (["a", [True]], "prompt[1]")])
def test_bad_prompts_are_refused(value, param):
    refused(param, ls.read_prompts, value)


class FakeEngine:
    """Tokenizes a character to its code point; a BOS (1) when asked for special tokens."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def tokenize_many(self, texts):
        self.calls.append(list(texts))
        return [tuple(([1] if add else []) + [ord(c) for c in text]) for text, add, _ in texts]


def test_a_mixed_prompt_is_tokenized_in_one_call_with_the_bos_only_before_a_leading_string():
    engine = FakeEngine()
    assert ls.token_ids(engine, ["a", 7, "b"]) == [1, 97, 7, 98]
    assert ls.token_ids(engine, [7, "b"]) == [7, 98]
    assert len(engine.calls) == 2


# -- /infill ----------------------------------------------------------------------------------------
PRE, SUF, MID, REP, SEP, BOS = 1001, 1002, 1003, 1004, 1005, 1
FIM = FimTokens(PRE, SUF, MID, REP, SEP)


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def layout(body: dict, fim=FIM, bos=None, n_ctx=N_CTX, n_predict=16) -> list[int]:
    infill = Infill.read({"input_prefix": "ab", "input_suffix": "yz", **body})
    return infill.layout(fim, {t: tok(t) for t in infill.texts()}, tok(infill.prompt), bos, n_ctx, n_predict)


def test_infill_is_prefix_and_prompt_then_suffix_then_middle():
    assert layout({"prompt": "c"}, fim=FimTokens(PRE, SUF, MID)) == [PRE, *tok("abc"), SUF, *tok("yz"), MID]
    assert layout({}, fim=FimTokens(PRE, SUF, MID), bos=BOS)[:2] == [BOS, PRE]


def test_other_files_come_first_in_the_repo_level_pattern():
    got = layout({"input_extra": [{"filename": "a.py", "text": "A=1"}, {"text": "B"}]})
    want = [REP, *tok("myproject\n"), SEP, *tok("a.py\n"), *tok("A=1"), SEP, *tok("tmp\n"), *tok("B"),
            SEP, *tok("filename\n"), PRE, *tok("ab"), SUF, *tok("yz"), MID]
    assert got == want


def test_without_repo_tokens_other_files_are_snippets():
    got = layout({"input_extra": [{"text": "A"}]}, fim=FimTokens(PRE, SUF, MID))
    assert got == [*tok(SNIPPET), *tok("A"), PRE, *tok("ab"), SUF, *tok("yz"), MID]


def test_long_inputs_are_cut_to_the_budget_keeping_what_is_nearest_the_cursor():
    n_ctx, n_predict = 64, 4                        # budget 32: prefix 24, suffix 8 - 2 - len(prompt)
    body = {"input_prefix": "p" * 50 + "P", "input_suffix": "S" + "s" * 50, "prompt": "c",
            "input_extra": [{"filename": "f", "text": "x" * 100 + "X"}]}
    got = layout(body, n_ctx=n_ctx, n_predict=n_predict)
    middle = [PRE, *tok("p" * 23 + "P"), *tok("c"), SUF, *tok("S" + "s" * 4), MID]
    assert got[-len(middle):] == middle
    extra = got[:-len(middle)]
    assert len(extra) == n_ctx - len(middle) - 2 * n_predict and extra[-len("filename\n") - 2:][:2] == [ord("X"), SEP]


@pytest.mark.parametrize("body,param", [
    ({"input_prefix": None}, "input_prefix"), ({"input_suffix": 3}, "input_suffix"), ({"prompt": [1]}, "prompt"),
    ({"input_extra": {}}, "input_extra"), ({"input_extra": [{"filename": "a"}]}, "input_extra[0].text"),
    ({"input_extra": [{"text": "a", "filename": 1}]}, "input_extra[0].filename")])
def test_bad_infill_bodies_are_refused_naming_the_field(body, param):
    refused(param, Infill.read, {"input_prefix": "", "input_suffix": "", **body})


# -- responses --------------------------------------------------------------------------------------
def done(reason="stop", stop_string=None) -> Done:
    return Done("r", reason, Usage(10, 4, 6), Timings(4, 6, 8.0, 3, 30.0, 0.0, N_CTX), stop_string, (5, 6, 7, 8))


def test_stop_types_and_timings():
    assert ls.stop_type(done("length")) == ("limit", "")
    assert ls.stop_type(done("stop", "END")) == ("word", "END")
    assert ls.stop_type(done("stop")) == ("eos", "")
    t = ls.timings(done())
    assert t["prompt_per_token_ms"] == 2.0 and t["predicted_per_token_ms"] == 10.0
    assert math.isclose(t["predicted_per_second"], 100.0) and t["cache_n"] == 6


def test_response_fields_pick_nested_values_by_their_path():
    out = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert ls.pick(out, ["content", "timings/prompt_n", "missing", "content/x"]) == {"content": "x",
                                                                                     "timings/prompt_n": 3}
    assert ls.pick(out, []) is out


def test_models_lists_every_alias_and_tag_and_each_alias_reaches_the_model(tmp_path):
    cfg = config.load({"model": str(write_tiny_llama(tmp_path / "tiny.gguf")), "model_alias": "coder,tiny-2",
                       "tags": "local,small", "conversations_db": str(tmp_path / "c.db")}, env={})
    pool = ModelPool(*catalog(cfg), cfg)           # nothing is loaded: /v1/models reads the catalog
    try:
        client = create_app(cfg, pool).test_client()
        card = client.get("/v1/models").get_json()["data"][0]
        assert (card["id"], card["aliases"], card["tags"]) == ("coder", ["coder", "tiny-2"], ["local", "small"])
        assert client.get("/v1/models/tiny-2").get_json()["id"] == "coder"
        assert client.get("/models").get_json()["data"] == [card]
    finally:
        pool.close()
