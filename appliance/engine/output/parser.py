"""What a chat reply's text goes through after the stop strings: the reasoning split, then
tool-call parsing of what is left. One object per request, owned by the scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from ..reasoning import ReasoningParser
from ..tool_stream import StreamParser
from ..types import ToolCall, ToolCallPart


@dataclass
class Piece:
    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()          # complete calls
    parts: tuple[ToolCallPart, ...] = ()      # the calls as they stream

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls or self.parts)


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: StreamParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def n_calls(self) -> int:
        return self.tools.n_calls if self.tools else 0

    def feed(self, text: str) -> Piece:
        return self._split(self.reasoning.feed(text) if self.reasoning else None, text, flush=False)

    def flush(self) -> Piece:
        return self._split(self.reasoning.flush() if self.reasoning else None, "", flush=True)

    def _split(self, split, text: str, flush: bool) -> Piece:
        reasoning, content = (split.reasoning, split.content) if split is not None else ("", text)
        if self.tools is None:
            return Piece(content, reasoning)
        got = self.tools.feed(content)
        content, calls, parts = got.content, got.calls, got.parts
        if flush:
            end = self.tools.flush()
            content, calls, parts = content + end.content, calls + end.calls, parts + end.parts
        return Piece(content, reasoning, calls, parts)
