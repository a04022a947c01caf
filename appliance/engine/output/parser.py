"""What a chat reply's text goes through after the stop strings: the model's format
(chat_formats/) reads reasoning, content and tool calls from it, streamed by one core
(chat_formats/stream.py). One object per reply, owned by the scheduler."""
from __future__ import annotations

from ..chat_formats import Context, Format
from ..chat_formats.stream import ChatStream, Piece

__all__ = ["OutputParser", "Piece"]


class OutputParser:
    def __init__(self, fmt: Format, ctx: Context) -> None:
        self.stream = ChatStream(fmt, ctx)

    @property
    def n_calls(self) -> int:
        return self.stream.n_calls

    def feed(self, text: str) -> Piece:
        return self.stream.feed(text)

    def flush(self) -> Piece:
        return self.stream.flush()
