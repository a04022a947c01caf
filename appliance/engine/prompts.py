"""From a request to what the scheduler runs: the prompt's token ids and the request's output
machinery. On the engine side of the boundary, next to the model: the chat template is
rendered (with the tools described the way the template expects), the text tokenized, token
ids from a client checked against the vocabulary, the reasoning and tool-call parsers set up,
and the grammar compiled when the output is constrained (a forced tool choice, a JSON schema).
The server never tokenizes."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import InvalidRequest, InvalidToken
from . import tool_stream, tools
from .chat import ChatTemplate
from .output.constraints import Constraints, Matcher
from .output.parser import OutputParser
from .reasoning import ReasoningParser, markers_for, prompt_opens_thinking
from .runners.base import ModelRunner, RunnerInfo
from .types import ChatMessage, Constraint, Request

log = logging.getLogger("appliance.engine")


@dataclass
class Prepared:
    ids: list[int]
    matcher: Matcher | None = None        # structured output: the grammar's state
    parser: OutputParser | None = None    # chat: reasoning and tool calls apart from content
    # choices 1..n-1 of a request with n > 1: each its own (matcher, parser)
    more: tuple[tuple[Matcher | None, OutputParser | None], ...] = ()


class PromptBuilder:
    def __init__(self, runner: ModelRunner, info: RunnerInfo,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.runner, self.info = runner, info
        self.template_kwargs = dict(template_kwargs or {})  # --chat-template-kwargs; a request's win
        self.template = ChatTemplate(info.chat_template, info.bos_text, info.eos_text)
        self.tool_format = tools.detect_format(info.chat_template)
        self.think_markers = markers_for(info.chat_template)
        if self.template.load_warning:
            log.warning("%s", self.template.load_warning)
        self.constraints = Constraints(runner.guidance_tokenizer, info.n_vocab)

    def prepare(self, req: Request) -> Prepared:
        """The prompt's ids and the request's parser and matcher (one of each per choice); a
        client mistake raises."""
        ids, text = self.prompt_ids(req)
        self.check_ids([t for t, _ in req.params.logit_bias], "logit_bias")
        outputs = [self._output(req, text) for _ in range(req.n)]
        return Prepared(ids, *outputs[0], more=tuple(outputs[1:]))

    def _output(self, req: Request, text: str) -> tuple[Matcher | None, OutputParser | None]:
        """A fresh matcher (structured output) and parser (reasoning, tool calls) for one reply."""
        constraint, tool_parser, parser = req.constraint, None, None
        if req.tools and req.tool_choice != "none":
            tool_parser = tool_stream.StreamParser(self.tool_format, {t.name for t in req.tools})
            if req.tool_choice != "auto":  # required, or one named function: never downgraded
                grammar = tools.grammar(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_format)
                constraint = Constraint("lark", grammar)
        if req.messages is not None:
            inside = prompt_opens_thinking(text, self.think_markers[0])
            parser = OutputParser(ReasoningParser(inside, self.think_markers), tool_parser)
        return (self.constraints.matcher(constraint) if constraint else None), parser

    def prompt_ids(self, req: Request) -> tuple[list[int], str]:
        """The prompt's tokens, and its text (empty when the client sent token ids)."""
        if req.prompt_ids is not None:
            if req.images:
                raise InvalidRequest("images go with a prompt's text, not with token ids", param="prompt")
            self.check_ids(req.prompt_ids, "prompt")
            return list(req.prompt_ids), ""
        if req.messages is not None:
            messages, kwargs = req.messages, {**self.template_kwargs, **dict(req.template_kwargs)}
            if req.tools and req.tool_choice != "none":
                if self.tool_format == "generic":
                    messages = tools.with_generic_tools(messages, req.tools)
                else:
                    kwargs["tools"] = tools.tool_dicts(req.tools)
            text = self.template.render(messages, req.add_generation_prompt, **kwargs)
            if req.continue_final:
                text = continued(text, messages[-1].content or "", self.template, messages, kwargs)
        else:
            text = req.prompt or ""
        if req.images:
            ids = self._with_images(text, req)
        else:
            ids = self.runner.tokenize(text, add_special=True, parse_special=True)
        bos = self.info.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote a BOS and the tokenizer added one
        return ids, text

    def _with_images(self, text: str, req: Request) -> list[int]:
        """Text tokens and each image's rows (runners/vision.py), or the refusal of a model
        that takes no images."""
        projector = getattr(self.runner, "projector", None)
        if projector is None:
            raise InvalidRequest(f"the model {self.info.model_name} does not take images: it is served without "
                                 "a vision projector (serve it with --mmproj FILE)",
                                 param="messages" if req.messages is not None else "prompt")
        return projector.tokenize(text, req.images, owner=req.id)

    def release(self, request_id: str) -> None:
        """The request is over: what its prompt held (its pictures) may go."""
        projector = getattr(self.runner, "projector", None)
        if projector is not None:
            projector.release(request_id)

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.info.n_vocab]
        if bad:
            raise InvalidToken(f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.info.n_vocab})", param=param)


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
