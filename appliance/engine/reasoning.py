"""Reasoning separation: a reply's leading <think>...</think> block becomes `reasoning_content`.

Only a block at the very start of the reply counts (after whitespace), so a model that merely
mentions the tag in its answer is not split. Templates that open the block themselves (the
generation prompt ends with <think>, as Qwen3's and DeepSeek-R1's do) start the parser inside
it. Streaming holds back only what could still be the closing tag.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def prompt_opens_thinking(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningParser:
    def __init__(self, inside: bool = False) -> None:
        self.state = "inside" if inside else "start"   # start -> inside -> after
        self.buf = ""
        self.strip = False  # the blank lines after </think> are not content

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN):], "inside"
            elif OPEN.startswith(head):
                return out  # could still become the opening tag
            else:
                self.state = "after"
        if self.state == "inside":
            at = self.buf.find(CLOSE)
            if at < 0:
                keep = next((n for n in range(min(len(CLOSE) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(CLOSE[:n])), 0)
                out.reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(CLOSE):], "after"
            self.strip = True
        if self.state == "after":
            if self.strip:
                self.buf = self.buf.lstrip()
                self.strip = not self.buf
            out.content, self.buf = self.buf, ""
        return out

    def flush(self) -> Split:
        """The end of the reply: whatever is held back is what it appeared to be."""
        text, self.buf = self.buf, ""
        if self.state == "inside":
            return Split(reasoning=text)
        return Split(content=text)
