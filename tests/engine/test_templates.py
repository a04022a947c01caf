"""Real models' chat templates through ChatTemplate: Qwen2.5-Instruct, Llama 3.1 / 3.2-Instruct
and Mistral-7B-Instruct-v0.3.

The template sources are the `chat_template` strings of the models' tokenizer_config.json,
JSON-decoded (so `\\n` inside a Jinja string literal is a Jinja escape, and the newlines between
tags are real). Llama 3.2 and Mistral v0.3 match public copies of those files; Qwen2.5 matches
a public reconstruction and the well-known original; Llama 3.1 is written from the original,
which differs from 3.2 only in its `builtin_tools` lines and a fixed default date_string.
"""
from __future__ import annotations

from datetime import datetime

import pytest

from appliance.chat_templates import TemplateError
from appliance.engine.chat import ChatTemplate
from appliance.engine.types import ChatMessage
from appliance.errors import InvalidRequest

QWEN25 = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''

# Llama 3.1 and 3.2 share everything from the system message on except how tools and the
# date are handled; the shared message loop:
_LLAMA3_MESSAGES = r'''
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

_LLAMA3_TOOLS_IN_USER = r'''
{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
'''

_LLAMA3_TOOLS_IN_SYSTEM = r'''
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
'''

LLAMA31 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}''' + _LLAMA3_TOOLS_IN_SYSTEM + _LLAMA3_TOOLS_IN_USER + _LLAMA3_MESSAGES

LLAMA32 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}''' + _LLAMA3_TOOLS_IN_SYSTEM + _LLAMA3_TOOLS_IN_USER + _LLAMA3_MESSAGES

MISTRAL_V03 = r'''{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
'''

LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|eot_id|>"
MISTRAL_BOS, MISTRAL_EOS = "<s>", "</s>"


def msgs(*pairs: tuple[str, str | None]) -> list[ChatMessage]:
    return [ChatMessage(role, content) for role, content in pairs]


CONVO = msgs(("system", "You are terse."), ("user", "Hi there"), ("assistant", "Hello."),
             ("user", "What is 2+2?"))


def in_order(text: str, *markers: str) -> bool:
    """Every marker occurs in text, each after the previous one."""
    pos = 0
    for m in markers:
        i = text.find(m, pos)
        if i < 0:
            return False
        pos = i + len(m)
    return True


# -- Qwen2.5 -----------------------------------------------------------------------------------

def test_qwen25_conversation():
    t = ChatTemplate(QWEN25, eos_token="<|im_end|>")
    assert not t.is_default and t.load_warning is None
    out = t.render(CONVO)
    assert out == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                   "<|im_start|>user\nHi there<|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n"
                   "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_qwen25_default_system_message():
    out = ChatTemplate(QWEN25).render(msgs(("user", "Hi")))
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                   "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen25_without_generation_prompt():
    out = ChatTemplate(QWEN25).render(CONVO, add_generation_prompt=False)
    assert out.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert out.count("<|im_start|>assistant") == 1  # only the earlier reply's


def test_qwen25_tools_branch_renders_with_tojson():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int"}}}]
    out = ChatTemplate(QWEN25).render(msgs(("user", "Add")), tools=tools)
    assert in_order(out, "<|im_start|>system\nYou are Qwen", "# Tools", "<tools>\n",
                    '{"type": "function", "function": {"name": "add"', "</tools>",
                    "<|im_start|>user\nAdd<|im_end|>\n", "<|im_start|>assistant\n")


# -- Llama 3.1 / 3.2 ---------------------------------------------------------------------------

def llama_expected(date: str, system: str = "You are terse.") -> str:
    return (LLAMA_BOS
            + "<|start_header_id|>system<|end_header_id|>\n\n"
            + "Cutting Knowledge Date: December 2023\n"
            + f"Today Date: {date}\n\n"
            + f"{system}<|eot_id|>"
            + "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            + "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            + "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>")


def test_llama31_conversation_says_todays_date_as_llama_server_does():
    # issue 55: the template's own default ("26 Jul 2024") gave way to date_string, today's date,
    # which llama-server puts in every template's context
    from datetime import datetime

    t = ChatTemplate(LLAMA31, bos_token=LLAMA_BOS, eos_token=LLAMA_EOS)
    out = t.render(CONVO)
    assert out == llama_expected(datetime.now().strftime("%d %b %Y")) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert in_order(out, LLAMA_BOS, "system<|end_header_id|>", "Cutting Knowledge Date",
                    "You are terse.", "user<|end_header_id|>", "Hi there",
                    "assistant<|end_header_id|>", "Hello.", "user<|end_header_id|>",
                    "What is 2+2?")


def test_llama31_date_string_kwarg_reaches_the_template():
    t = ChatTemplate(LLAMA31, bos_token=LLAMA_BOS)
    out = t.render(CONVO, add_generation_prompt=False, date_string="01 Jan 2030")
    assert out == llama_expected("01 Jan 2030")


def test_llama32_dates_today_with_strftime_now():
    t = ChatTemplate(LLAMA32, bos_token=LLAMA_BOS, eos_token=LLAMA_EOS)
    before = datetime.now()
    out = t.render(CONVO)
    after = datetime.now()
    dates = {d.strftime("%d %b %Y") for d in (before, after)}
    assert out in {llama_expected(d) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
                   for d in dates}


def test_llama32_without_generation_prompt_and_system_message():
    t = ChatTemplate(LLAMA32, bos_token=LLAMA_BOS)
    out = t.render(msgs(("user", "  padded  "), ("assistant", "Reply ")),
                   add_generation_prompt=False, date_string="02 Feb 2025")
    assert out == (LLAMA_BOS + "<|start_header_id|>system<|end_header_id|>\n\n"
                   "Cutting Knowledge Date: December 2023\nToday Date: 02 Feb 2025\n\n<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nReply<|eot_id|>")
    assert not out.endswith("<|end_header_id|>\n\n")


def test_llama32_tools_in_first_user_message():
    tools = [{"name": "add", "parameters": {"a": {"type": "integer"}}}]
    out = ChatTemplate(LLAMA32, bos_token=LLAMA_BOS).render(
        msgs(("user", "Add 1 and 2")), tools=tools, date_string="02 Feb 2025")
    assert in_order(out, "system<|end_header_id|>\n\nEnvironment: ipython\n",
                    "user<|end_header_id|>\n\nGiven the following functions",
                    '{\n    "name": "add"', "Add 1 and 2<|eot_id|>",
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama3_template_with_no_user_message_and_tools_is_a_400():
    with pytest.raises(TemplateError) as ei:
        ChatTemplate(LLAMA31).render(msgs(("system", "only a system message")), tools=[{"name": "f"}])
    assert ei.value.status == 400 and "no first user message" in ei.value.message


# -- Mistral-7B-Instruct-v0.3 --------------------------------------------------------------------

def test_mistral_v03_conversation_puts_system_in_last_user_turn():
    t = ChatTemplate(MISTRAL_V03, bos_token=MISTRAL_BOS, eos_token=MISTRAL_EOS)
    out = t.render(CONVO)
    assert out == ("<s>[INST] Hi there[/INST] Hello.</s>"
                   "[INST] You are terse.\n\nWhat is 2+2?[/INST]")
    assert in_order(out, "<s>", "[INST] Hi there", "[/INST]", " Hello.", "</s>", "[INST] ",
                    "You are terse.", "What is 2+2?", "[/INST]")
    # the template has no generation prompt: the prompt already ends where the reply begins
    assert out.endswith("[/INST]")
    assert t.render(CONVO, add_generation_prompt=False) == out


@pytest.mark.parametrize("conversation", [
    msgs(("user", "a"), ("user", "b")),
    msgs(("assistant", "I speak first")),
    msgs(("system", "s"), ("user", "a"), ("assistant", "b"), ("assistant", "c")),
])
def test_mistral_v03_refuses_non_alternating_roles(conversation):
    t = ChatTemplate(MISTRAL_V03, bos_token=MISTRAL_BOS, eos_token=MISTRAL_EOS)
    with pytest.raises(InvalidRequest) as ei:
        t.render(conversation)
    assert isinstance(ei.value, TemplateError)
    assert ei.value.status == 400 and ei.value.code == "invalid_request"
    assert "roles must alternate user/assistant/user/assistant" in ei.value.message
    assert ei.value.body()["error"]["type"] == "invalid_request_error"


def test_mistral_v03_refuses_unknown_roles():
    t = ChatTemplate(MISTRAL_V03, bos_token=MISTRAL_BOS, eos_token=MISTRAL_EOS)
    with pytest.raises(TemplateError) as ei:
        t.render(msgs(("user", "a"), ("assistant", "b"), ("user", "c"), ("developer", "d")))
    # a non-user role in an assistant's place passes the alternation check, then is refused
    assert "Only user and assistant roles are supported" in ei.value.message
    with pytest.raises(TemplateError) as ei:
        t.render(msgs(("user", "a"), ("tool", "42")))
    assert "Tool call IDs" in ei.value.message


# -- all three -------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,bos,header", [
    (QWEN25, "", "<|im_start|>assistant\n"),
    (LLAMA31, LLAMA_BOS, "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    (LLAMA32, LLAMA_BOS, "<|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_generation_prompt_is_exactly_the_assistant_header(source, bos, header):
    t = ChatTemplate(source, bos_token=bos)
    with_prompt = t.render(CONVO, date_string="03 Mar 2025")
    without = t.render(CONVO, add_generation_prompt=False, date_string="03 Mar 2025")
    assert with_prompt == without + header
    assert not without.endswith(header)


@pytest.mark.parametrize("source", [QWEN25, LLAMA31, LLAMA32, MISTRAL_V03])
def test_templates_compile_and_do_not_touch_the_callers_messages(source):
    t = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert not t.is_default and t.load_warning is None
    conversation = msgs(("user", "Hi"), ("assistant", "Yo"), ("user", "Bye"))
    before = list(conversation)
    t.render(conversation)
    t.render(conversation)  # `set messages = messages[1:]` inside a template is local
    assert conversation == before

