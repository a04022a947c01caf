"""Chat templates: the GGUF's own Jinja template, rendered in jinja2's immutable sandbox, as
llama-server renders it.

The environment, which mirrors what Hugging Face's `apply_chat_template` gives templates, is
appliance/chat_templates/'s (compile_template). A model without a template gets ChatML;
`--chat-template` puts a shipped one (appliance/chat_templates/), a name llama.cpp renders, or a
file's in place of the GGUF's before this module sees it (startup._with_template). A template
that raises (for example "roles must alternate"), or that recurses past the stack on deeply
nested tools or arguments, is the client's mistake: an InvalidRequest, never a crash.

What llama-server gives a template besides the messages, this gives too (common/chat.cpp):
today's date as `date_string` ("04 Dec 2026") and `datetime` ("Dec 04 2026"), so a Llama 3.x
template says today's date and not its own default; `enable_thinking` true unless the request
(or --reasoning) says otherwise, for a template that has the switch; and for a template that
refuses a system message, the system text joined to the next message's. A name of
llama.cpp's (`chat_templates.by_llama_cpp`) is rendered by llama.cpp's llama_chat_apply_template
itself: roles and texts only, so earlier tool calls are written out as the generic tool format's,
and where the format drops tool messages, results are user turns in <tool_response> tags.
"""
from __future__ import annotations

import ctypes
from datetime import datetime
from typing import Any, Callable, Sequence

import jinja2

from .. import jsondepth
from ..chat_templates import GIVEN, SHIPPED, TemplateError, by_llama_cpp, compile_template, given, load_template
from ..errors import InvalidRequest
from .reasoning import has_thinking_switch
from .types import ChatMessage, ToolCall

RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"   # the generic (hermes) tool format's

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML
        self.is_default = source is None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.load_warning: str | None = None
        self.llama_cpp = self.source if by_llama_cpp(self.source) else None
        if self.source in SHIPPED:   # a template that is a shipped name (llama-server reads "chatml" so)
            self.source = load_template(self.source)[1]
        try:
            self.template = compile_template(self.source)
        except jinja2.TemplateError as e:
            # a broken template in a GGUF: serve with ChatML rather than not at all
            self.source, self.is_default = CHATML, True
            self.template = compile_template(CHATML)
            self.load_warning = f"the model's chat template does not compile ({e}); using ChatML"
        self.thinking_switch = has_thinking_switch(self.source)
        self.system_role = self.llama_cpp is not None or self._takes_system()
        self.tool_role = self.llama_cpp is not None and "RESULT" in apply_llama_cpp(
            self.llama_cpp, [ChatMessage("user", "a"), ChatMessage("tool", "RESULT")], False)
        self.takes_tools = self.llama_cpp is None and self._takes_tools()
        # the reply format's rewrite of the messages before they render (ChatLayer sets it)
        self.rewrite: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
        self.object_arguments = self.llama_cpp is None and self._takes_object_arguments()

    def _takes_tools(self) -> bool:
        """Whether the template declares the tools it is given (llama.cpp's supports_tools caps
        probe): such a template gets a request's tools, as llama-server hands them over."""
        tool = {"type": "function", "function": {"name": "tool_probe_name", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            out = self.template.render(messages=[{"role": "user", "content": "User message"}], tools=[tool],
                                       add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception:   # noqa: BLE001 - a template that fails on tools does not take them
            return False
        return "tool_probe_name" in out

    def _takes_object_arguments(self) -> bool:
        """Whether earlier calls' arguments go to the template as objects (Hugging Face's
        convention, which llama.cpp follows where the template can take them) or as the JSON
        text (functionary's `'\n' + arguments` cannot add an object to text)."""
        call = {"id": "call00001", "type": "function", "function": {"name": "tool1", "arguments": {"arg": "value"}}}
        probe = [{"role": "user", "content": "User message"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"}]
        try:
            self.template.render(messages=probe, add_generation_prompt=False, bos_token=self.bos_token,
                                 eos_token=self.eos_token)
        except Exception:   # noqa: BLE001 - a template that fails on an object takes the text
            return False
        return True

    def _takes_system(self) -> bool:
        """Whether the template takes a system message (llama.cpp's caps probe): one that refuses
        it (Gemma's "System role not supported") gets its text joined to the next message's, as
        llama-server does."""
        probe = [{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}]
        try:
            self.template.render(messages=probe, add_generation_prompt=False, bos_token=self.bos_token,
                                 eos_token=self.eos_token)
        except Exception:   # noqa: BLE001 - any refusal of the probe is "no system role"
            return False
        return True

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        if self.llama_cpp is not None:
            if not self.tool_role:   # a format that drops tool messages: results as user turns, not lost
                messages = [ChatMessage("user", f"{RESULT_OPEN}\n{m.content or ''}\n{RESULT_CLOSE}")
                            if m.role == "tool" else m for m in messages]
            return apply_llama_cpp(self.llama_cpp, messages, add_generation_prompt)
        msgs = [_message_dict(m, self.object_arguments) for m in messages]
        if not self.system_role and len(msgs) > 1 and msgs[0]["role"] == "system":
            msgs = [{**msgs[1], "content": msgs[0]["content"] + "\n" + msgs[1]["content"]}, *msgs[2:]]
        elif not self.system_role and msgs and msgs[0]["role"] == "system":
            msgs = msgs[1:]
        if self.rewrite is not None:
            msgs = self.rewrite(msgs)
        now = datetime.now()   # llama-server's extra context; a request's kwargs may set them
        context = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
                   **({"enable_thinking": True} if self.thinking_switch else {}), **kwargs}
        token = GIVEN.set(given(msgs, context))
        try:
            return self.template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **context)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise InvalidRequest(f"the chat template tried an unsafe operation: {e}") from None
        except RecursionError:  # a template's recursive macro (a schema walk), or tojson, one call per level
            raise TemplateError("the model's chat template ran out of stack on these messages and tools: "
                                "they nest too deeply for it") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise TemplateError(f"the model's chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from None
        finally:
            GIVEN.reset(token)


def _message_dict(m: ChatMessage, object_arguments: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        # Hugging Face's convention: arguments as an object (templates apply tojson), where the
        # template can take one; else the text
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": _arguments(c) if object_arguments
                                         else c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    return d


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object. The server checked them (wire.load_json); a request made
    elsewhere gets the same refusal rather than the parser's RecursionError."""
    try:
        return jsondepth.loads(call.arguments)
    except ValueError:
        raise InvalidRequest(f"the arguments of tool call {call.id!r} are not JSON nesting at most "
                             f"{jsondepth.MAX_DEPTH} levels", param="messages") from None


def apply_llama_cpp(name: str, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
    """`messages` in llama.cpp's built-in template `name` (llama_chat_apply_template): roles and
    texts; an assistant's tool calls are written after its text in the generic tool format."""
    import llama_cpp as L

    from .tools import written_calls

    texts = [((m.content or "") + "\n" + written_calls(m.tool_calls)).strip() if m.tool_calls else (m.content or "")
             for m in messages]
    keep = [(m.role.encode(), t.encode()) for m, t in zip(messages, texts)]   # alive while llama.cpp reads them
    chat = (L.llama_chat_message * len(keep))(*(L.llama_chat_message(role, text) for role, text in keep))
    size = 2 * sum(len(r) + len(t) for r, t in keep) + 256
    for _ in range(2):   # it answers the length it needs: a second call with that much room
        buf = ctypes.create_string_buffer(size)
        n = L.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            raise TemplateError(f"llama.cpp's chat template {name!r} refused these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise TemplateError(f"llama.cpp's chat template {name!r} gave no prompt")
