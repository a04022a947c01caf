"""Real models' chat templates and the requests their renderings are compared on.

The .jinja files beside this one are copies of llama.cpp's models/templates/ (from the vendored
llama.cpp of llama-cpp-python 0.3.36's sdist), which holds them as the models' repositories
publish them. `llama_server.json` is what llama.cpp's own code (common_chat_templates_init and
common_chat_templates_apply, as llama-server calls them) made of each case, written by
scripts/llama_template_render/expected.py; today's date in it is DATE_STRING / DATETIME, and
ISO_DATE or LONG_DATE where a template asks strftime_now itself (`DATES`: Mistral Small 3.2,
Granite 3.3).
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
EXPECTED = HERE / "llama_server.json"
# what llama-server puts in a template's context for today (common_chat_extra_context)
DATE_STRING, DATETIME = "{date_string}", "{datetime}"
ISO_DATE = "{iso_date}"   # a template's own strftime_now("%Y-%m-%d")
LONG_DATE = "{long_date}"   # a template's own strftime_now("%B %d, %Y") (Granite 3.3)
# the strftime format of each: a rendering holds today's date in it, the placeholder in the file
DATES = {"%d %b %Y": DATE_STRING, "%b %d %Y": DATETIME, "%Y-%m-%d": ISO_DATE, "%B %d, %Y": LONG_DATE}
# SmolLM2's vocabulary, which the tiny GGUF fixtures carry: the bos_token and eos_token a template sees
BOS, EOS = "<|im_start|>", "<|im_end|>"

# every template of llama.cpp's models/templates/ (70): llama_server.json renders the cases below for each,
# and llama_chat.json (scripts/llama_chat_reference/record.py) holds llama.cpp's parse of replies in each
ALL_TEMPLATES = sorted(p.stem for p in HERE.glob("*.jinja"))
# the ones the engine's prompt builder is held to (test_template_parity)
TEMPLATES = ["CohereForAI-c4ai-command-r-plus-tool_use", "Mistral-Small-3.2-24B-Instruct-2506", "Qwen-QwQ-32B",
             "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
             "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "google-gemma-2-2b-it", "meta-llama-Llama-3.1-8B-Instruct",
             "meta-llama-Llama-3.2-3B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Mistral's templates take only ids of 9 letters and digits
CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# name -> (messages, tools, --reasoning: -1 auto, 0 off, 1 on)
CASES: dict[str, tuple[list[dict], list[dict] | None, int]] = {
    "system": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}], None, -1),
    "turns": ([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "What is 2+2?"}], None, -1),
    "thinking_off": ([{"role": "user", "content": "What is 2+2?"}], None, 0),
    "thinking_on": ([{"role": "user", "content": "What is 2+2?"}], None, 1),
    "tools": ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
              [WEATHER], -1),
    "tool_result": ([{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "18 C and sunny"}], [WEATHER], -1),
}


def template(name: str) -> str:
    return (HERE / f"{name}.jinja").read_text()


def expected() -> dict[str, dict[str, str]]:
    """template -> case -> llama-server's rendering (`DATES`' placeholders for today)."""
    return json.loads(EXPECTED.read_text())


CHAT_REFERENCE = HERE / "llama_chat.json"


def chat_reference() -> dict:
    """template -> {"format", "apply", "turn_end", "cases", "skipped"}: llama.cpp's parse of model replies
    (scripts/llama_chat_reference/record.py describes the fields); {} where the file is absent."""
    return json.loads(CHAT_REFERENCE.read_text()) if CHAT_REFERENCE.exists() else {}
