"""Llama 3.x and the Llama-3-based function formats, as llama.cpp's automatic parser reads them
(jsoncalls.AutoJson rows):

    Llama 3.1 / 3.2 / 3.3:  {"name": "f", "parameters": {...}}        (content before it, up to "{";
                            an optional leading "type": "function", as the OpenAI wrapper writes it;
                            one call: the templates take no parallel calls. <|python_tag|> and the
                            builtin tools are not read: llama.cpp reads neither)
    FireFunction v2:        functools[{"name": "f", "arguments": {...}}, ...]
    Functionary v3.1:       <function=f>{...}</function>
"""
from __future__ import annotations

from .jsoncalls import AutoJson


class Llama3(AutoJson):
    name = "llama3"
    needles = ('"parameters": ', "<|start_header_id|>")
    order = ("name", "parameters")
    openai_wrapper = True


class FireFunction(AutoJson):
    name = "firefunction-v2"
    needles = ("functools",)
    section = ("functools", "")
    array = True


class FunctionaryV31(AutoJson):
    name = "functionary-v3.1"
    needles = ("<function=", "<|start_header_id|>")
    tools = "tag"
    per_call = ("<function=", "</function>")
    name_suffix = ">"


FAMILIES = [FireFunction, FunctionaryV31, Llama3]
