"""Real models' chat templates rendered as llama-server renders them.

Every template of llama.cpp's models/templates/ (70, copied into chat_templates/) renders each
request of cases.py through the engine's prompt builder, and the prompt must be llama.cpp's own
rendering of the same template (llama_server.json, written by scripts/llama_template_render/ with
llama.cpp's common/chat.cpp), today's date included: the template's own tool declarations, earlier
calls and results written back as it writes them, its thinking switch. Eleven of them (Llama 3.1
and 3.2, Qwen 2.5 and 3, QwQ, the DeepSeek-R1 distills, Command-R+, Mistral Nemo and Small 3.2,
Gemma 2) first go into a tiny GGUF as a model's file carries them and are read back through
llama.cpp's vocabulary as the engine reads them. A template with no tool support that no format
family reads would get the tools described in its system message (the generic path); there the
test holds the rest.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime

import llama_cpp as L
import pytest

from appliance.engine import tools
from appliance.engine.prompts import PromptBuilder
from appliance.engine.runners.vocab import Vocab, load_model
from appliance.engine.types import ToolSpec
from appliance.errors import InvalidRequest
from web.wire import parse_chat

from .chat_templates import cases
from .fake_runner import FakeRunner
from .gguf_fixtures import write_tiny


class Runner(FakeRunner):
    guidance_tokenizer = None     # no constrained output here


@pytest.fixture(scope="module")
def builders(tmp_path_factory) -> dict[str, PromptBuilder]:
    """A prompt builder per template, over what llama.cpp reads from the template's tiny GGUF."""
    out = {}
    for name in cases.ALL_TEMPLATES:
        if name not in cases.TEMPLATES:   # the rest straight from the file: the GGUF round trip is the same
            runner = Runner()
            info = dataclasses.replace(runner.info, chat_template=cases.template(name), bos_text=cases.BOS,
                                       eos_text=cases.EOS)
            out[name] = PromptBuilder(runner, info)
            continue
        path = write_tiny(tmp_path_factory.mktemp("tpl") / f"{name}.gguf", "llama", n_layer=1, n_embd=16,
                          n_head=2, n_head_kv=1, n_ff=16, chat_template=cases.template(name))
        model = load_model(path, vocab_only=True)
        try:
            facts = Vocab(model).facts()
        finally:
            L.llama_model_free(model)
        assert facts["chat_template"] == cases.template(name)
        assert (facts["bos_text"], facts["eos_text"]) == (cases.BOS, cases.EOS)
        runner = Runner()
        info = dataclasses.replace(runner.info, chat_template=facts["chat_template"], bos_text=facts["bos_text"],
                                   eos_text=facts["eos_text"])
        out[name] = PromptBuilder(runner, info)
    return out


def ours(builder: PromptBuilder, case: str) -> str | None:
    """The engine's prompt for a case (None: the template refused it, a 400)."""
    messages, tool_list, reasoning = cases.CASES[case]
    body: dict = {"messages": messages, **({"tools": tool_list} if tool_list else {})}
    if reasoning >= 0:   # --reasoning on/off is this, as every request's default (test_builtin_templates)
        body["chat_template_kwargs"] = {"enable_thinking": bool(reasoning)}
    try:
        return builder.prompt_ids(parse_chat(body, "r", {"m"}, 4096).request)[1]
    except InvalidRequest:
        return None


def today(text: str | None) -> str | None:
    now = datetime.now()
    for fmt, placeholder in cases.DATES.items():
        text = None if text is None else text.replace(placeholder, now.strftime(fmt))
    return text


EXPECTED = cases.expected()
WEATHER = (ToolSpec("get_weather", cases.WEATHER["function"]["description"],
                    json.dumps(cases.WEATHER["function"]["parameters"])),)
PAIRS = [(name, case) for name in cases.ALL_TEMPLATES for case in cases.CASES]


@pytest.mark.parametrize("name,case", PAIRS, ids=[f"{n}-{c}" for n, c in PAIRS])
def test_the_prompt_is_llama_servers(builders, name, case):
    builder, want = builders[name], today(EXPECTED[name][case])
    got = ours(builder, case)
    if not builder.chat.tools_in_template and cases.CASES[case][1] and want is not None:
        # the tools described in the system message, calls written as that description says
        assert got is not None and tools.generic_system_prompt(WEATHER) in got
        return
    assert got == want


def test_llama_3_says_todays_date_and_qwq_thinks_unless_told_not_to(builders):
    date = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {date}\n" in ours(builders["meta-llama-Llama-3.1-8B-Instruct"], "system")
    assert ours(builders["Qwen-QwQ-32B"], "thinking_on").endswith("<|im_start|>assistant\n<think>\n")
    assert ours(builders["Qwen-QwQ-32B"], "thinking_off").endswith("<think>\n</think>")
    # Gemma refuses a system message: its text goes to the next message, as llama-server sends it
    assert "<start_of_turn>user\nYou are terse.\nHi there<end_of_turn>" in ours(builders["google-gemma-2-2b-it"],
                                                                              "system")
