"""What the JSON-argument families' tests share (jsoncalls.AutoJson rows and their specialized
neighbours): the recorded cases of a group of templates, llama.cpp's known differences, and the
check that a family's grammar takes a canonical call text that its parse reads back."""
from __future__ import annotations

import json

from appliance.engine.chat_formats import Context, Format, detect

from ..chat_templates import cases as templates
from .byte_grammar import accepts, compiles

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
