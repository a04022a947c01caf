"""Chat templates: the GGUF's own Jinja template, rendered in jinja2's immutable sandbox.

The environment, which mirrors what Hugging Face's `apply_chat_template` gives templates, is
appliance/chat_templates/'s (compile_template). A model without a template gets ChatML;
`--chat-template` puts a shipped one (appliance/chat_templates/) or a file's in place of the
GGUF's before this module sees it (startup._with_template). A template that raises
(for example "roles must alternate"), or that recurses past the stack on deeply nested tools or
arguments, is the client's mistake: an InvalidRequest, never a crash.
"""
from __future__ import annotations

from typing import Any, Sequence

import jinja2

from .. import jsondepth
from ..chat_templates import TemplateError, compile_template
from ..errors import InvalidRequest
from .types import ChatMessage, ToolCall

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
        try:
            self.template = compile_template(self.source)
        except jinja2.TemplateError as e:
            # a broken template in a GGUF: serve with ChatML rather than not at all
            self.source, self.is_default = CHATML, True
            self.template = compile_template(CHATML)
            self.load_warning = f"the model's chat template does not compile ({e}); using ChatML"
        else:
            self.load_warning = None

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        msgs = [_message_dict(m) for m in messages]
        try:
            return self.template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        **kwargs)
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


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        # Hugging Face's convention: arguments as an object (templates apply tojson)
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": _arguments(c)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object. The server checked them (wire.load_json); a request made
    elsewhere gets the same refusal rather than the parser's RecursionError."""
    try:
        return jsondepth.loads(call.arguments)
    except ValueError:
        raise InvalidRequest(f"the arguments of tool call {call.id!r} are not JSON nesting at most "
                             f"{jsondepth.MAX_DEPTH} levels", param="messages") from None
