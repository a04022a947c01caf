"""The other templates llama.cpp reads with its automatic parser: JSON calls in lists or tags, and
the templates without calls, as jsoncalls.AutoJson rows (llama.cpp's analysis of each template):

    Hermes 2 Pro / 3, Qwen 2.5, MiMo-VL, Granite 4.x:  <tool_call>\\n{"name": "f", "arguments": {...}}</tool_call>
    Qwen3, QwQ, Bielik, Reka Edge:    the same after <think>...</think> (each template's own whitespace)
    Apertus:                          <|tools_prefix|>[{"f": {...}}, ...]<|tools_suffix|>
    Apriel 1.5 / 1.6:                 <tool_calls>[{"name": "f", "arguments": {...}}]</tool_calls>
                                      (1.6: reasoning until [BEGIN FINAL RESPONSE], opened by the prompt)
    MiniMax-M1:                       <tool_calls>\\n{"name": "f", "arguments": {...}}\\n</tool_calls> (one call)
    NVIDIA Nemotron Nano v2:          <TOOLCALL>[{"name": "f", "arguments": {...}}, ...]</TOOLCALL>, after
                                      <think>...</think> (opened by the prompt)
    Solar Open:                       <|tool_calls|><|tool_call:begin|>call00001<|tool_call:name|>f
                                      <|tool_call:args|>{...}<|tool_call:end|><|calls|>
    no calls (content, and reasoning where the template thinks): Gemma 2, Phi-3.5, RWKV World,
                                      SmolLM3, Granite 3.3
"""
from __future__ import annotations

from .jsoncalls import AutoJson

TOOL_CALL = ("<tool_call>\n", "</tool_call>")


class Hermes(AutoJson):
    name = "hermes-json"
    needles = ("<tool_call>", "<|im_start|>")
    per_call = TOOL_CALL


class Qwen3(Hermes):
    name = "qwen3"
    needles = ("<tool_call>", "<|im_start|>", "<think>\\n\\n</think>")
    reasoning = ("<think>\n", "\n</think>\n\n")


class QwQ(Hermes):
    name = "qwq"
    needles = ("<tool_call>", "<|im_start|>assistant\\n<think>\\n")
    reasoning = ("<think>", "</think>")
    opened = "<think>\n"


class Bielik(Hermes):
    name = "bielik"
    needles = ("<tool_call>", "Bielik")
    reasoning = ("<think>\n", "\n</think>\n")


class Reka(Hermes):
    name = "reka-edge"
    needles = ("<tool_call>", "assistant: ")
    reasoning = ("<think>\n", "\n</think>\n\n")


class Granite4(Hermes):
    name = "granite4"
    needles = ("<tool_call>", "<|start_of_role|>")


class Apertus(AutoJson):
    name = "apertus"
    needles = ("<|tools_prefix|>",)
    section = ("<|tools_prefix|>", "<|tools_suffix|>")
    array = True
    name_is_key = True


class Apriel15(AutoJson):
    name = "apriel-1.5"
    needles = ("<tool_calls>", "[BEGIN FINAL RESPONSE]", "<|assistant|>")
    section = ("<tool_calls>", "</tool_calls>")
    array = True


class Apriel16(Apriel15):
    name = "apriel-1.6"
    needles = ("<tool_calls>", "Here are my reasoning steps")
    reasoning = ("<|begin_assistant|>\n", "\n[BEGIN FINAL RESPONSE]\n")
    opened = "<|begin_assistant|>\nHere are my reasoning steps:\n"


class Solar(AutoJson):
    name = "solar-open"
    needles = ("<|tool_call:name|>",)
    wrap = ("<|content|>", "<|end|>")
    tools = "tag"
    section = ("<|tool_calls|>", "<|calls|>")
    per_call = ("<|tool_call:begin|>", "<|tool_call:end|>")
    name_prefix = "call00001<|tool_call:name|>"
    name_suffix = "<|tool_call:args|>"


class MiniMaxM1(AutoJson):
    name = "minimax-m1"
    needles = ("<tool_calls>", "ai name=assistant")
    section = ("<tool_calls>\n", "</tool_calls>")


class NemotronV2(AutoJson):
    name = "nemotron-v2"
    needles = ("<TOOLCALL>",)
    reasoning = ("<think>", "</think>")
    section = ("<TOOLCALL>", "</TOOLCALL>")
    array = True


class Plain(AutoJson):
    """A template that writes no calls: llama.cpp reads its replies as content (and reasoning)."""
    name = "plain"
    tools = None


class Gemma2(Plain):
    name = "gemma2"
    needles = ("<start_of_turn>",)


class Phi35(Plain):
    name = "phi3.5"
    needles = ("<|assistant|>", "<|end|>")


class RwkvWorld(Plain):
    name = "rwkv-world"
    needles = ("Assistant:", "<think>")
    reasoning = ("<think>", "\n</think>")

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False    # llama.cpp finds no generation prompt here: its " <think>" is not prepended


class SmolLM3(Plain):
    name = "smollm3"
    needles = ("/no_think", "<|im_start|>")
    reasoning = ("<think>", "</think>")


class Granite33(Plain):
    name = "granite3.3"
    needles = ("<|start_of_role|>", "<response>")
    reasoning = ("<think>", "</think>")


FAMILIES = [Apertus, Apriel16, Apriel15, MiniMaxM1, NemotronV2, Solar, Qwen3, QwQ, Bielik, Reka, Granite33, Granite4, Hermes,
            SmolLM3, Gemma2, Phi35, RwkvWorld]
