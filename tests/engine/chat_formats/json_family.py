"""What the JSON-argument families' tests share (jsoncalls.AutoJson rows and their specialized
neighbours): the recorded cases of a group of templates, llama.cpp's known differences, the
check that a family's grammar takes a canonical call text that its parse reads back, and the one
that its forced grammar takes the recorded replies with their markers as special tokens."""
from __future__ import annotations

import json
import re
from functools import lru_cache

import llguidance
import pytest

from appliance.engine.chat_formats import Context, Format, detect
from appliance.engine.output.special_tokens import with_special_tokens

from ..chat_templates import cases as templates
from .byte_grammar import accepts, compiles
from .reference import context, reference

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                         "required": ["city"]},
         "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                 "required": ["a", "b"]}}
CALLS = [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3.5})]

# cases llama.cpp reads with what the appliance's parse does not see (case name -> why)
RESPONSE_FORMAT = "a response_format (json_schema) request: llama.cpp's parser reads the JSON out of a ```json fence"


def names(templates_: list[str]) -> dict[str, str]:
    return {t: detect(templates.template(t)).name for t in templates_}


def calls_of(fmt: Format, text: str, ctx: Context | None = None) -> list[tuple[str, dict]]:
    got = fmt.parse(text, ctx or Context(tools=TOOLS), partial=False)
    return [(c.name, json.loads(c.arguments)) for c in got.calls]


def grammar_takes(fmt: Format, text: str, parallel: bool = True) -> bool:
    """The family's grammar compiles and takes `text`, which its parse reads as CALLS (or the first)."""
    ctx = Context(tools=TOOLS, parallel=parallel)
    g = fmt.grammar(ctx, "required")
    want = CALLS if parallel else CALLS[:1]
    return bool(g) and compiles(g) and accepts(g, text) and calls_of(fmt, text, ctx) == want


# --- the forced grammar with the markers as special tokens --------------------------------------

def forced(templates_: list[str]) -> list:
    """pytest params (template, case, choice) of every recorded reply of `templates_` from which
    llama.cpp read calls (test_grammars.py's), under "required" and under the first call's name."""
    out = []
    for t in templates_:
        for c in (reference().get(t) or {}).get("cases", []):
            msg, r = c.get("message"), c["request"]
            if (c.get("partial") or not msg or not msg.get("tool_calls") or r["messages"][-1]["role"] == "assistant"
                    or r.get("tool_choice", "auto") == "none" or r.get("json_schema")
                    or r.get("reasoning_format") == "none"):
                continue
            names_ = [x["name"] for x in msg["tool_calls"]]
            for choice in ["required"] + ([names_[0]] if len(set(names_)) == 1 else []):
                out.append(pytest.param(t, c, choice, id=f"{t}-{c['name']}-{choice}"))
    return out


def special_tokens(template: str) -> list[str]:
    """The template's markers a vocabulary has as special tokens: llama.cpp's preserved tokens
    that are whole tags, <...> or [...]."""
    return [m for m in reference()[template]["apply"]["tools"]["preserved_tokens"]
            if len(m) > 2 and '"' not in m and (m[0], m[-1]) in (("<", ">"), ("[", "]"))]


def check_forced_special(template: str, case: dict, choice: str) -> None:
    """The forced grammar, its markers made the vocabulary's special tokens (special_tokens.py),
    takes the reply fed as tokens (each marker one token) up to where it is complete, and what
    it took reads back as llama.cpp's calls."""
    fmt = detect(templates.template(template))
    ctx = context(fmt, case["request"], case.get("generation_prompt") or
                  reference()[template]["apply"]["tools"]["generation_prompt"])
    specials = special_tokens(template)
    split = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")") if specials else None
    grammar = fmt.grammar(ctx, choice)
    lark = with_special_tokens(grammar, lambda s: [(x, 257 + specials.index(x)) for x in split.split(s) if x in specials]
                               if split else [])
    m = llguidance.LLMatcher(vocabulary(tuple(specials)), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    taken = ""
    for piece in (p for p in (split.split(case["reply"]) if split else [case["reply"]]) if p):
        ids = [257 + specials.index(piece)] if piece in specials else list(piece.encode())
        for i, tok in enumerate(ids):
            if m.is_stopped() or not m.consume_token(tok):
                assert m.is_stopped() or m.is_accepting(), f"refused after {taken!r}:\n{lark}"
                taken += piece.encode()[:i].decode(errors="replace") if piece not in specials else ""
                return _reads_back(fmt, ctx, taken, case)
        taken += piece
    assert m.is_accepting(), f"not complete at the end:\n{lark}"
    _reads_back(fmt, ctx, taken, case)


def _reads_back(fmt: Format, ctx: Context, taken: str, case: dict) -> None:
    want = [(c["name"], json.loads(c["arguments"] or "{}")) for c in case["message"]["tool_calls"]]
    assert calls_of(fmt, taken, ctx) == want


@lru_cache(maxsize=None)
def vocabulary(specials: tuple[str, ...]) -> llguidance.LLTokenizer:
    """The 256 bytes, an end of sequence and `specials` as special tokens (257...)."""
    class Vocab:
        eos_token_id, bos_token_id = 256, None
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"] + [s.encode() for s in specials]
        special_token_ids = list(range(256, 257 + len(specials)))

        def __call__(self, text: bytes) -> list[int]:
            return list(text)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))
