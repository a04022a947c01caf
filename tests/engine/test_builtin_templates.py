"""`--chat-template NAME`: every name llama.cpp accepts (llama_chat_builtin_templates), rendered
as its llama_chat_apply_template renders it; the Jinja files shipped under some of those names
(and "mistral"), rendered to the exact strings their formats define, with tools; a Jinja file as
the template; the names and files refused; `--chat-template-kwargs` and `--reasoning` under a
request's own; the override in the engine's info."""
from __future__ import annotations

import ctypes
import json
import re

import llama_cpp
import pytest

from appliance.chat_templates import BUILTIN, LLAMA_CPP, SHIPPED, load_template
from appliance.config import EngineConfig
from appliance.engine.chat_layer import ChatLayer
from appliance.engine.chat import ChatTemplate
from appliance.engine.prompts import PromptBuilder
from appliance.engine.startup import _with_template
from appliance.engine.types import ChatMessage, Request, ToolCall

from .fake_runner import FakeRunner

CONVO = (ChatMessage("system", "You are terse."), ChatMessage("user", "Hi there"),
         ChatMessage("assistant", "Hello."), ChatMessage("user", "What is 2+2?"))
BOS, EOS = "<s>", "</s>"

# each format's rendering of CONVO with the generation prompt, and the generation prompt itself
EXPECTED = {
    "chatml": ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
               "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
               "<|im_start|>assistant\n", "<|im_start|>assistant\n"),
    "gemma": ("<s><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
              "Hello.<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
              "<start_of_turn>model\n"),
    "llama3": ("<s><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n",
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": ("<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][INST]Hi there[/INST]Hello.</s>"
                "[INST]What is 2+2?[/INST]", ""),
    "phi3": ("<|system|>\nYou are terse.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello.<|end|>\n"
             "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n", "<|assistant|>\n"),
}


def builtin(name: str) -> ChatTemplate:
    source, text = load_template(name)
    assert source == f"builtin:{name}"
    return ChatTemplate(text, BOS, EOS)


def test_every_shipped_file_has_its_expected_rendering():
    assert set(SHIPPED) == set(EXPECTED) == {"chatml", "gemma", "llama3", "mistral", "phi3"}


def llama_cpp_names() -> list[str]:
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return [name.decode() for name in names]


def llama_cpp_render(name: str, messages, add: bool) -> str:
    """llama.cpp's own rendering, called here without the engine's code."""
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m.role.encode(), m.content.encode()) for m in messages))
    buf = ctypes.create_string_buffer(8192)
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), add, buf, 8192)
    assert 0 <= n <= 8192
    return buf.raw[:n].decode()


def test_the_names_are_every_one_llama_cpp_accepts():
    assert sorted(LLAMA_CPP) == sorted(llama_cpp_names()) and len(LLAMA_CPP) > 50
    assert set(BUILTIN) == set(LLAMA_CPP) | {"mistral"}        # the one name of the appliance's own


@pytest.mark.parametrize("name", LLAMA_CPP)
def test_every_llama_cpp_name_means_what_it_means_to_llama_cpp(name):
    t = builtin(name)
    for add in (True, False):
        # a shipped file writes the BOS llama.cpp leaves to the tokenizer (the prompt builder keeps one)
        got = t.render(CONVO, add_generation_prompt=add)
        assert (got.removeprefix(BOS) if name in SHIPPED else got) == llama_cpp_render(name, CONVO, add)


def test_a_name_llama_cpp_renders_keeps_tool_calls_and_results():
    out = builtin("vicuna").render(ROUND_TRIP)       # vicuna has no tool role: results are user turns
    assert out == ('Be exact.\n\nUSER: Add\nASSISTANT: <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
                   "</tool_call></s>\nUSER: <tool_response>\n1\n</tool_response>\nUSER: <tool_response>\n2\n"
                   "</tool_response>\nASSISTANT:")
    out = builtin("phi4").render(ROUND_TRIP)            # phi4 has one: results as llama.cpp writes them
    assert "<|im_start|>tool<|im_sep|>1<|im_end|><|im_start|>tool<|im_sep|>2<|im_end|>" in out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_a_conversation_exactly(name):
    t = builtin(name)
    assert t.load_warning is None and not t.is_default
    with_prompt, header = EXPECTED[name]
    assert t.render(CONVO) == with_prompt
    assert t.render(CONVO, add_generation_prompt=False) + header == with_prompt


CALL = ToolCall("call_1", "add", json.dumps({"a": 1}))
ROUND_TRIP = (ChatMessage("system", "Be exact."), ChatMessage("user", "Add"),
              ChatMessage("assistant", None, tool_calls=(CALL,)), ChatMessage("tool", "1", tool_call_id="call_1"),
              ChatMessage("tool", "2", tool_call_id="call_1"))
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_JSON = '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}'


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_a_tool_round_trip(name):
    # a format without tools gets them described in the system message (the prompt builder's
    # generic path) and renders the results as user turns
    out = builtin(name).render(ROUND_TRIP, tools=TOOLS)
    assert re.search(r"Add.*\b1\b.*\b2\b", out, re.S)


def test_chatml_gives_tools_as_hermes_and_qwen_templates_do():
    out = builtin("chatml").render(ROUND_TRIP, tools=TOOLS)
    assert out == ("<|im_start|>system\nBe exact.\n\n# Tools\n\nYou may call one or more functions to assist "
                   "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
                   f"XML tags:\n<tools>\n{TOOL_JSON}\n</tools>\n\nFor each function call, return a json object "
                   "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
                   "<|im_start|>user\nAdd<|im_end|>\n"
                   '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                   "<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_llama3_gives_tools_in_the_system_turn_and_results_as_ipython():
    out = builtin("llama3").render(ROUND_TRIP[:4], tools=TOOLS)
    assert out.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
                          "You have access to the following functions.")
    assert out.endswith('Be exact.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAdd<|eot_id|>'
                        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 1}}'
                        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n1<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_mistral_lists_tools_before_the_last_user_turn():
    convo = (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello."), *ROUND_TRIP[1:4])
    out = builtin("mistral").render(convo, tools=TOOLS)
    assert out == (f"<s>[INST]Hi[/INST]Hello.</s>[AVAILABLE_TOOLS][{TOOL_JSON}][/AVAILABLE_TOOLS][INST]Add[/INST]"
                   '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "call_1"}]</s>'
                   '[TOOL_RESULTS]{"content": "1", "call_id": "call_1"}[/TOOL_RESULTS]')


@pytest.mark.parametrize("name,fmt", [("chatml", "hermes-json"), ("llama3", "llama3"), ("mistral", "mistral-nemo"),
                                      ("gemma", "generic"), ("phi3", "generic"), ("llama2", "generic"),
                                      ("deepseek3", "generic")])
def test_the_tool_call_format_follows_the_builtin(name, fmt):
    """The family whose calls the template writes; generic where it writes none (the tools
    described in a system message, the calls read as that description asks)."""
    assert ChatLayer(load_template(name)[1]).tool_format.name == fmt


def test_a_jinja_file_is_a_template(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    source, text = load_template(str(path))
    assert source == f"file:{path}"
    assert ChatTemplate(text).render(CONVO[1:2]) == "[user] Hi there\n[assistant] "


def test_an_unknown_name_lists_the_builtins(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in one .bailing, bailing-think, .*, chatml, command-r, "):
        load_template("chatml2")
    with pytest.raises(ValueError, match="neither a built-in one"):
        load_template(str(tmp_path))              # a directory


def test_a_file_that_is_not_jinja_is_refused_with_its_line(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("ok\n{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad.jinja: line 2: .*endfor"):
        load_template(str(path))


class Runner(FakeRunner):
    guidance_tokenizer = None     # no constrained output in these tests


def rendered(cfg: EngineConfig, **kwargs) -> str:
    runner = Runner()
    builder = PromptBuilder(runner, _with_template(runner.info, cfg), cfg.template_kwargs())
    req = Request("r", messages=CONVO[1:2], template_kwargs=tuple(kwargs.items()))
    return builder.prompt_ids(req)[1]


def test_default_kwargs_go_under_the_requests_own(tmp_path):
    path = tmp_path / "greet.jinja"
    path.write_text("{{ greeting }} {{ name | default('nobody') }}: {{ messages[0].content }}")
    cfg = EngineConfig(chat_template=str(path), chat_template_kwargs='{"greeting": "Hello", "name": "Ada"}')
    assert rendered(cfg) == "Hello Ada: Hi there"
    assert rendered(cfg, name="Bob") == "Hello Bob: Hi there"     # the request wins key by key


def test_the_override_replaces_the_models_template_in_the_engines_info():
    info = Runner().info
    assert _with_template(info, EngineConfig()).chat_template_source == "fallback:chatml"   # the GGUF has none
    chatml = _with_template(info, EngineConfig(chat_template="chatml"))
    assert chatml.chat_template_source == "builtin:chatml" and chatml.chat_template == load_template("chatml")[1]
    assert rendered(EngineConfig(chat_template="vicuna")).endswith("USER: Hi there\nASSISTANT:")
    deepseek3 = _with_template(info, EngineConfig(chat_template="deepseek3"))
    assert deepseek3.chat_template_source == "builtin:deepseek3" and deepseek3.chat_template == "deepseek3"
    assert rendered(EngineConfig(chat_template="deepseek3")) == "<｜User｜>Hi there<｜Assistant｜>"


def test_reasoning_is_the_default_of_enable_thinking_under_a_requests_own(tmp_path):
    path = tmp_path / "think.jinja"
    path.write_text("{{ messages[0].content }}{% if enable_thinking %} <think>{% else %} <no-think>{% endif %}")
    assert rendered(EngineConfig(chat_template=str(path))) == "Hi there <think>"   # llama-server's default: on
    assert rendered(EngineConfig(chat_template=str(path), reasoning="off")) == "Hi there <no-think>"
    assert rendered(EngineConfig(chat_template=str(path), reasoning="off"), enable_thinking=True) == "Hi there <think>"
    assert rendered(EngineConfig(chat_template=str(path), reasoning="on",
                                 chat_template_kwargs='{"x": 1}')) == "Hi there <think>"
    with pytest.raises(ValueError, match="--reasoning off and --chat-template-kwargs enable_thinking true say "
                                         "opposite things: give one of them"):
        EngineConfig(reasoning="off", chat_template_kwargs='{"enable_thinking": true}')
    with pytest.raises(ValueError, match="reasoning must be on, off or auto"):
        EngineConfig(reasoning="yes")
