"""One model's chat layer, as llama.cpp's common/chat is: its template (chat.py) renders a
request's messages and tools into the prompt's text, and its reply format (chat_formats/) reads
reasoning, content and tool calls back out of the reply, with the grammar a forced tool choice
is held to. `PromptBuilder` tokenizes what this renders; `appliance template` runs it alone.

A template that declares tools gets a request's tools, as llama-server hands them over, and
its calls are read in its own format. One that declares none gets them described in a system
message, in the generic format (tools.py), which is the format its calls are read in.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping, Sequence

from ..errors import InvalidRequest
from . import chat_formats, tools
from .chat import ChatTemplate
from .output.parser import OutputParser
from .reasoning import markers_for
from .types import ChatMessage, Constraint, Request

SCHEMAS = ("json_object", "json_schema")

log = logging.getLogger("appliance.engine")


class ChatLayer:
    def __init__(self, template: str | None, bos: str = "", eos: str = "",
                 template_kwargs: Mapping[str, Any] | None = None, reasoning_format: str = "auto") -> None:
        self.template_kwargs = dict(template_kwargs or {})  # --chat-template-kwargs; a request's win
        self.reasoning_format = reasoning_format            # --reasoning-format; a request's wins
        self.template = ChatTemplate(template, bos, eos)
        if self.template.load_warning:
            log.warning("%s", self.template.load_warning)
        self.format = chat_formats.detect(None if self.template.is_default else self.template.source)
        if type(self.format) is chat_formats.Format:   # content only: the reasoning markers the template names
            self.format.think = markers_for(template)
        source = self.template.source
        self.template.rewrite = lambda msgs: self.format.messages(msgs, source)
        if not self.format.supports_thinking:   # llama-server turns enable_thinking on only where it reads thinking
            self.template.thinking_switch = False
        # tools go to the template, as llama-server hands them over, where it declares them or
        # where a family reads its calls; else they are described in a system message
        self.tools_in_template = self.format.reads_calls or self.template.takes_tools
        if not self.tools_in_template:   # its own reasoning and content, the generic calls in them
            self.tool_format: chat_formats.Format = chat_formats.Generic(self.format)
        elif not self.format.reads_calls:      # a template whose call format no family reads
            self.tool_format = chat_formats.by_name("hermes")
        else:
            self.tool_format = self.format

    def render(self, req: Request) -> str:
        """The prompt's text for a chat request."""
        messages, kwargs = req.messages or (), {**self.template_kwargs, **dict(req.template_kwargs)}
        if req.tools and req.tool_choice != "none":
            if not self.tools_in_template:
                messages = tools.with_generic_tools(messages, req.tools)
            else:
                kwargs["tools"] = tools.tool_dicts(req.tools)
        text = self.template.render(messages, req.add_generation_prompt, **kwargs)
        if req.continue_final:
            text = continued(text, messages[-1].content or "", self.template, messages, kwargs)
        return text

    def context(self, req: Request, prompt: str) -> tuple[chat_formats.Format, chat_formats.Context]:
        """The format a reply to `req` is read in, and what its parser needs of the request."""
        calls = bool(req.tools) and req.tool_choice != "none"
        fmt = self.tool_format if calls else self.format
        return fmt, chat_formats.Context(
            tools={t.name: json.loads(t.parameters_json) for t in req.tools} if calls else {},
            thinking_open=fmt.prompt_opens_thinking(prompt),
            extract_reasoning=(req.reasoning_format or self.reasoning_format) != "none",
            parallel=req.parallel_tool_calls)

    def parser(self, req: Request, prompt: str) -> OutputParser:
        return OutputParser(*self.context(req, prompt))

    def answer_constraint(self, req: Request, prompt: str) -> Constraint | None:
        """`response_format` for a chat reply in a model's own format: the schema holds the
        answer after its reasoning (gpt-oss's final channel), not the reasoning; as given for a
        template whose format is plain content (and for completions)."""
        c = req.constraint
        fmt, ctx = self.context(req, prompt)
        if c is None or req.messages is None or type(fmt) is chat_formats.Format or c.kind not in SCHEMAS:
            return c
        schema = {"type": "object"} if c.kind == "json_object" else json.loads(c.schema_json or "{}")
        grammar = fmt.answer_grammar(schema, ctx)
        return Constraint("lark", grammar) if grammar is not None else c

    def tool_grammar(self, req: Request, prompt: str) -> str | None:
        """A forced tool choice's grammar (required, or one named function) in the model's own
        format (the hermes one where its family has none); None for auto and none."""
        if not req.tools or req.tool_choice in ("auto", "none"):
            return None
        fmt, ctx = self.context(req, prompt)
        grammar = fmt.grammar(ctx, req.tool_choice)
        return grammar if grammar is not None else chat_formats.by_name("hermes").grammar(ctx, req.tool_choice)

    def lazy_tool_grammar(self, req: Request, prompt: str) -> tuple[str, Callable[[str], bool], tuple[str, ...]] | None:
        """`tool_choice: auto`'s grammar, llama.cpp's lazy one: the required choice's grammar,
        held from where the reply begins a call (what tells it: the format's reading of the text,
        and its trigger strings); None without tools, or where the format has no grammar."""
        if not req.tools or req.tool_choice != "auto" or req.constraint is not None:
            return None
        fmt, ctx = self.context(req, prompt)
        grammar = fmt.grammar(ctx, "required")
        if grammar is None:
            return None
        return grammar, lambda text: fmt.call_begins(text, ctx), fmt.triggers(ctx)


def continued(text: str, content: str, template: ChatTemplate, messages: Sequence[ChatMessage],
              kwargs: dict) -> str:
    """The rendered prompt cut after the final message's text, so that the model goes on with it
    (vLLM's continue_final_message: the template closes the message; its end is dropped)."""
    if not content.strip():
        # nothing to continue: the same as a new assistant turn
        return template.render(messages[:-1], True, **kwargs)
    for probe in (content, content.rstrip(), content.strip()):
        at = text.rfind(probe)
        if at >= 0:
            return text[:at + len(probe)]
    raise InvalidRequest("the chat template does not reproduce the final message's text, so it "
                         "cannot be continued; send continue_final_message: false", param="messages")
