"""From a request to what the scheduler runs: the prompt's token ids and the request's output
machinery. On the engine side of the boundary, next to the model: the chat template is
rendered (with the tools described the way the template expects), the text tokenized, token
ids from a client checked against the vocabulary, the reasoning and tool-call parsers set up,
and the grammar compiled when the output is constrained (a forced tool choice, a JSON schema).
The server never tokenizes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import InvalidRequest, InvalidToken
from .chat_layer import ChatLayer
from .output.constraints import Constraints, LazyMatcher, Matcher
from .output.parser import OutputParser
from .runners.base import ModelRunner, RunnerInfo
from .types import Constraint, Request


@dataclass
class Prepared:
    ids: list[int]
    matcher: Matcher | None = None        # structured output: the grammar's state
    parser: OutputParser | None = None    # chat: reasoning and tool calls apart from content
    # choices 1..n-1 of a request with n > 1: each its own (matcher, parser)
    more: tuple[tuple[Matcher | None, OutputParser | None], ...] = ()


class PromptBuilder:
    def __init__(self, runner: ModelRunner, info: RunnerInfo,
                 template_kwargs: Mapping[str, Any] | None = None, reasoning_format: str = "auto") -> None:
        self.runner, self.info = runner, info
        self.chat = ChatLayer(info.chat_template, info.bos_text, info.eos_text, template_kwargs, reasoning_format)
        self.template = self.chat.template
        self.constraints = Constraints(runner.guidance_tokenizer, info.n_vocab, self._tokens, self._piece)

    def prepare(self, req: Request) -> Prepared:
        """The prompt's ids and the request's parser and matcher (one of each per choice); a
        client mistake raises."""
        ids, text = self.prompt_ids(req)
        self.check_ids([t for t, _ in req.params.logit_bias], "logit_bias")
        outputs = [self._output(req, text) for _ in range(req.n)]
        return Prepared(ids, *outputs[0], more=tuple(outputs[1:]))

    def _output(self, req: Request, text: str) -> tuple[Matcher | LazyMatcher | None, OutputParser | None]:
        """A fresh matcher (structured output) and parser (reasoning, tool calls) for one reply."""
        if req.constraint is not None:
            self.constraints.check(req.constraint)
        constraint = self.chat.answer_constraint(req, text) if req.constraint is not None else None
        grammar = self.chat.tool_grammar(req, text)
        if grammar is not None:   # required, or one named function: never downgraded
            constraint = Constraint("lark", grammar)
        parser = self.chat.parser(req, text) if req.messages is not None else None
        lazy = self.chat.lazy_tool_grammar(req, text) if constraint is None and req.messages is not None else None
        if lazy is not None:   # tool_choice auto: held to the format's grammar once a call begins
            grammar, begins, triggers = lazy
            return self.constraints.lazy(Constraint("lark", grammar), begins, triggers), parser
        return (self.constraints.matcher(constraint) if constraint else None), parser

    def _tokens(self, text: str) -> list[int]:
        return self.runner.tokenize(text, add_special=False, parse_special=True)

    def _piece(self, tok: int) -> bytes:
        return self.runner.detokenize([tok])

    def prompt_ids(self, req: Request) -> tuple[list[int], str]:
        """The prompt's tokens, and its text (empty when the client sent token ids)."""
        if req.prompt_ids is not None:
            if req.images:
                raise InvalidRequest("images go with a prompt's text, not with token ids", param="prompt")
            self.check_ids(req.prompt_ids, "prompt")
            return list(req.prompt_ids), ""
        text = self.chat.render(req) if req.messages is not None else (req.prompt or "")
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

