"""Chat templates: ChatML default, HF-compatible environment, the sandbox, broken templates."""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from appliance.chat_templates import TemplateError
from appliance.engine.chat import CHATML, ChatTemplate
from appliance.errors import InvalidRequest
from appliance.engine.types import ChatMessage, ToolCall

# SmolLM2-135M-Instruct's template as stored in its GGUF (the '\n' are Jinja string escapes)
SMOLLM2 = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    r"<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    r"'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def msgs(*pairs: tuple[str, str | None]) -> list[ChatMessage]:
    return [ChatMessage(role, content) for role, content in pairs]


# -- ChatML default ----------------------------------------------------------------------------

def test_none_gives_chatml_default():
    t = ChatTemplate(None)
    assert t.is_default and t.source == CHATML and t.load_warning is None
    out = t.render(msgs(("system", "Be brief."), ("user", "Hi")))
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_chatml_without_generation_prompt_and_none_content():
    out = ChatTemplate(None).render(msgs(("user", "Hi"), ("assistant", None)),
                                    add_generation_prompt=False)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


def test_custom_template_is_not_default():
    t = ChatTemplate("{{ messages[0]['content'] }}")
    assert not t.is_default and t.load_warning is None
    assert t.render(msgs(("user", "x"))) == "x"


def test_bos_eos_and_kwargs_reach_the_template():
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}|{{ extra }}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render(msgs(("user", "hi")), extra="k") == "<s>hi</s>|k"


# -- SmolLM2's real template -------------------------------------------------------------------

def test_smollm2_template_adds_default_system_prompt():
    out = ChatTemplate(SMOLLM2).render(msgs(("user", "What is 2+2?")))
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                   "Hugging Face<|im_end|>\n"
                   "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_smollm2_template_keeps_given_system_prompt():
    out = ChatTemplate(SMOLLM2).render(
        msgs(("system", "S"), ("user", "U"), ("assistant", "A"), ("user", "V")),
        add_generation_prompt=False)
    assert out == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                   "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nV<|im_end|>\n")


# -- the HF-compatible environment -------------------------------------------------------------

def test_raise_exception_gives_template_error():
    t = ChatTemplate("{% if messages[0]['role'] != 'system' %}"
                     "{{ raise_exception('first message must be system') }}{% endif %}ok")
    with pytest.raises(TemplateError) as ei:
        t.render(msgs(("user", "hi")))
    assert isinstance(ei.value, InvalidRequest)
    assert ei.value.status == 400
    assert "first message must be system" in ei.value.message
    assert t.render(msgs(("system", "s"))) == "ok"


def test_render_failure_is_a_template_error():
    t = ChatTemplate("{{ messages[5]['content'] + 1 }}")
    with pytest.raises(TemplateError):
        t.render(msgs(("user", "hi")))


# a schema walked by a recursive macro, as gpt-oss's template renders tool parameters
WALK = ("{%- macro walk(s) -%}{%- if s is mapping -%}{ {%- for k, v in s.items() -%}{{ k }}: {{ walk(v) }}"
        "{%- endfor -%} }{%- else -%}{{ s }}{%- endif -%}{%- endmacro -%}"
        "{% for t in tools %}{{ walk(t) }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_a_template_out_of_stack_on_deep_tools_is_a_template_error():
    deep: dict = {"type": "string"}
    for _ in range(255):        # 511 levels: about the deepest a request may hold (jsondepth.MAX_DEPTH)
        deep = {"type": "object", "properties": {"a": deep}}
    t = ChatTemplate(WALK)
    with pytest.raises(TemplateError) as ei:
        t.render(msgs(("user", "hi")), tools=[deep])
    assert "nest too deeply" in ei.value.message
    assert t.render(msgs(("user", "hi")), tools=[{"type": "object"}]) == "{type: object}hi"


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_tool_call_arguments_nested_too_deep_are_refused_not_a_recursion_error(depth):
    args = '{"a": ' + "[" * depth + "]" * depth + "}"
    m = ChatMessage("assistant", None, tool_calls=(ToolCall("c1", "f", args),))
    with pytest.raises(InvalidRequest) as ei:
        ChatTemplate(None).render([m])
    assert ei.value.param == "messages" and "'c1'" in ei.value.message


def test_strftime_now():
    out = ChatTemplate("{{ strftime_now('%Y') }}").render(msgs(("user", "x")))
    assert out in {str(datetime.now().year), str(datetime.now().year - 1)}


def test_tojson_with_indent():
    t = ChatTemplate("{{ tools | tojson(indent=2) }}")
    tools = [{"name": "f", "params": {"a": "é"}}]
    out = t.render(msgs(("user", "x")), tools=tools)
    assert out == json.dumps(tools, indent=2, ensure_ascii=False)
    assert "\n  " in out


def test_tojson_default_keeps_unicode():
    out = ChatTemplate("{{ x | tojson }}").render(msgs(("user", "x")), x={"k": "ü"})
    assert json.loads(out) == {"k": "ü"} and "ü" in out


def test_loop_controls_break_and_continue():
    t = ChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}"
                     "{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]"
                     "{% endfor %}")
    out = t.render(msgs(("system", "s"), ("user", "a"), ("user", "b"), ("assistant", "c"),
                        ("user", "d")))
    assert out == "[a][b]"


def test_trim_and_lstrip_blocks():
    src = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(src).render(msgs(("user", "a"), ("user", "b"))) == "a\nb\n"


# -- the sandbox ---------------------------------------------------------------------------------

@pytest.mark.parametrize("src", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{% set _ = messages.pop() %}done",
    "{{ messages[0].update({'role': 'system'}) }}",
])
def test_sandbox_refuses_unsafe_operations(src):
    t = ChatTemplate(src)
    with pytest.raises(InvalidRequest) as ei:
        t.render(msgs(("user", "hi")))
    assert ei.value.status == 400
    assert "unsafe" in ei.value.message


# -- broken templates ---------------------------------------------------------------------------

def test_non_compiling_template_falls_back_to_chatml():
    t = ChatTemplate("{% for m in messages %}{{ m.content }")
    assert t.is_default and t.source == CHATML
    assert t.load_warning and "ChatML" in t.load_warning
    assert t.render(msgs(("user", "hi"))) == ChatTemplate(None).render(msgs(("user", "hi")))


def test_unknown_tag_falls_back_to_chatml():
    t = ChatTemplate("{% transformers_only %}{{ messages }}{% endtransformers_only %}")
    assert t.is_default and t.load_warning is not None


def test_hugging_faces_generation_block_renders_its_body():
    """{% generation %} (Hugging Face's assistant-mask marker; Laguna, LFM2.5) renders as it is."""
    t = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert not t.is_default and t.render(msgs(("user", "hi")), add_generation_prompt=False) == "[hi]"


def test_a_template_may_change_its_own_lists_but_not_what_it_is_given():
    """Kimi K2 queues call ids in a list it made (append, pop); the messages stay read-only."""
    t = ChatTemplate("{% set q = namespace(ids=[]) %}{% set _ = q.ids.append('a') %}{{ q.ids.pop(0) }}")
    assert t.render(msgs(("user", "hi"))) == "a"
    with pytest.raises(InvalidRequest, match="unsafe"):
        ChatTemplate("{{ messages[0].update({'content': 'x'}) }}").render(msgs(("user", "hi")))
