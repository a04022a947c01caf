"""Each scalar request parameter is declared once (web/params.py): wire validates with the
declaration and openapi publishes it. These tests hold the three together, and grow with the
declarations: a new parameter is checked without a new test."""
from __future__ import annotations

import math
from typing import Any, Callable

import pytest

from appliance.errors import InvalidRequest
from web import openapi, params, tokens, wire
from web import openapi_apis
from web.params import Param

N_CTX = 2048
SERVED = {"m"}
DOC = openapi_apis.build("m", N_CTX, n_vocab=1000)


def _body(path: str) -> dict[str, Any]:
    return DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]


def _chat(body: dict) -> Any:
    return wire.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, "r", SERVED, N_CTX)


def _completion(body: dict) -> Any:
    return wire.parse_completion({"prompt": "x", **body}, "r", SERVED, N_CTX)


def _stream_options(body: dict) -> Any:
    return _chat({"stream": True, "stream_options": body})


def _tokenize(body: dict) -> Any:
    return tokens.parse_tokenize({"content": "x", **body})


# (where, declarations, the published properties, the parser that uses them, hand-written scalars)
PLACES: list[tuple[str, dict[str, Param], dict[str, Any], Callable[[dict], Any], set[str]]] = [
    # the model is a string named by the served model, checked by check_model (a 404, not a 400)
    ("chat", params.CHAT, _body("/v1/chat/completions"), _chat, {"model"}),
    ("completion", params.COMPLETION, _body("/v1/completions"), _completion, {"model"}),
    ("stream_options", params.STREAM_OPTIONS,
     _body("/v1/chat/completions")["stream_options"]["properties"], _stream_options, set()),
    ("tokenize", params.TOKENIZE, _body("/tokenize"), _tokenize, {"content"}),  # required, not a knob
]
# what a parameter needs beside it for its values to be accepted
COMPANIONS = {"top_logprobs": {"logprobs": True},
              "continue_final_message": {"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "Hello"}]}}


@pytest.mark.parametrize("where,table,props,parse,hand", PLACES, ids=[p[0] for p in PLACES])
def test_every_declared_param_is_in_the_openapi_schema_alike(where, table, props, parse, hand):
    for name, p in table.items():
        assert name in props, f"{where}: {name} is declared but not published"
        s = props[name]
        lo, hi = p.bounds(N_CTX)
        assert s["type"] == p.kind, name
        assert (s.get("minimum"), s.get("maximum")) == (lo, hi), name
        assert s.get("enum") == (list(p.enum) if p.enum else None), name
        assert s["nullable"] is True, name  # null means the default, everywhere
        assert s.get("default") == p.default, name
        assert s["description"] == p.help and p.help, name


@pytest.mark.parametrize("where,table,props,parse,hand", PLACES, ids=[p[0] for p in PLACES])
def test_every_scalar_of_the_openapi_schema_is_declared(where, table, props, parse, hand):
    scalars = {k for k, s in props.items() if s.get("type") in params.KINDS}
    assert scalars - set(table) == hand


def test_openapi_speculate_takes_every_mode_wire_takes():
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert _body(path)["speculate"]["enum"] == ["off", "lookup", "draft", "mtp"]
        assert _body(path)["max_tokens"]["maximum"] == N_CTX


def _outside(p: Param) -> list[Any]:
    """Values just outside what `p` declares, and of the wrong type."""
    if p.enum:
        return ["not-one-of-them", [p.enum[0]]]
    if p.kind == "boolean":
        return ["yes", 1, 0]
    integer = p.kind == "integer"
    lo, hi = p.bounds(N_CTX)
    out: list[Any] = ["1", True, (lo or 0) + 0.5 if integer else float("nan")]
    if lo is not None:
        out.append(lo - 1 if integer else math.nextafter(lo, -math.inf))
    if hi is not None:
        out.append(hi + 1 if integer else math.nextafter(hi, math.inf))
    return out


def _at_bounds(p: Param) -> list[Any]:
    if p.enum:
        return [*p.enum, None]
    if p.kind == "boolean":
        return [True, False, None]
    return [v for v in p.bounds(N_CTX) if v is not None] + [None]


def _cases(values: Callable[[Param], list[Any]]) -> list[Any]:
    return [pytest.param(parse, name, v, id=f"{where}-{name}-{v!r}")
            for where, table, _, parse, _ in PLACES for name, p in table.items() for v in values(p)]


@pytest.mark.parametrize("parse,name,value", _cases(_outside))
def test_wire_refuses_values_just_outside_the_declaration(parse, name, value):
    with pytest.raises(InvalidRequest) as ei:
        parse({**COMPANIONS.get(name, {}), name: value})
    assert ei.value.status == 400 and ei.value.param == name


@pytest.mark.parametrize("parse,name,value", _cases(_at_bounds))
def test_wire_accepts_values_at_the_declared_bounds(parse, name, value):
    parse({**COMPANIONS.get(name, {}), name: value})


@pytest.mark.parametrize("where,table,parse", [("chat", params.CHAT, _chat),
                                               ("completion", params.COMPLETION, _completion)])
def test_wire_defaults_are_the_declared_ones(where, table, parse):
    """What the document publishes as a default is what an absent parameter gets."""
    parsed = parse({})
    checked = 0
    for name, p in table.items():
        for holder in (parsed.request.params, parsed.request, parsed):
            if p.default is not None and hasattr(holder, name):
                assert getattr(holder, name) == p.default, name
                checked += 1
                break
    assert checked >= 10
