"""The formats models write their replies in: reasoning, content and tool calls, each family in
its own module behind this registry (vLLM's tool_parsers/ is the model).

A format is detected once, from the chat template's source, by the first family in FAMILIES
whose `detect` says yes: the order is llama.cpp's (common_chat_try_specialized_template), the
specific before the general. Adding a model is a row in a family's table or a module here, never
an edit to the scheduler or a dialect: `detect` reads the template, `parse` reads the reply
(base.py says the one rule a parser keeps), and `stream.py` streams every family the same way.
"""
from __future__ import annotations

from . import cohere, deepseek, json_lists, llama3, mistral
from .base import Call, Context, Format, Parsed
from .cohere import Cohere2MoE
from .dsml import Dsml, DsmlV4
from .kimi import KimiK2
from .mistral import Ministral3
from .functionary import Functionary
from .gemma4 import Gemma4
from .gigachat import GigaChat, GigaChat31
from .harmony import Harmony
from .hermes import Generic, TaggedJson
from .kimi_k3 import KimiK3
from .muse import Muse
from .pythonic import Pythonic, PythonicThinking
from .xml_calls import XmlCalls
from .xml_minimax import MiniMaxM3
from .xml_rows import Glm, Glm46, Hy3, Ling3, MiniCpm5, MiniMaxM2, Qwen3Coder, SeedOss

# most specific first
FAMILIES: list[type[Format]] = [
    Ministral3,                     # llama.cpp's specialized parsers, in its order
    Harmony,
    Muse,
    KimiK2,
    Functionary,
    KimiK3,
    Ling3,
    Cohere2MoE,
    PythonicThinking, Pythonic,
    GigaChat,
    MiniMaxM3,
    DsmlV4, Dsml,
    Gemma4,
    MiniCpm5,
    XmlCalls, Qwen3Coder,
    SeedOss, MiniMaxM2, Hy3, Glm46, Glm,   # its automatic parser's XML rows
    *deepseek.FAMILIES, *mistral.FAMILIES, *llama3.FAMILIES,   # and its JSON rows (jsoncalls.AutoJson)
    *cohere.FAMILIES, *json_lists.FAMILIES,
    GigaChat31,
    TaggedJson,
]


def detect(template: str | None) -> Format:
    """The format of replies to `template` (a Jinja source): its family's, else plain content
    with <think> reasoning (Format itself)."""
    src = template or ""
    for family in FAMILIES:
        if family.detect(src):
            return family()
    return Format()


def by_name(name: str) -> Format:
    for family in [*FAMILIES, Generic, Format]:
        if family.name == name:
            return family()
    raise KeyError(name)


__all__ = ["Call", "Context", "Format", "Parsed", "FAMILIES", "detect", "by_name", "Generic"]
