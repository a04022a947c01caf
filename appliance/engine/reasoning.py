"""Reasoning separation: a reply's leading <think>...</think> block becomes `reasoning_content`.

The markers are the template's own where it names a known pair ([THINK]...[/THINK] for
Magistral, <seed:think> for Seed-OSS, ...), else <think>...</think>.

Only a block at the very start of the reply counts (after whitespace), so a model that merely
mentions the tag in its answer is not split. Templates that open the block themselves (the
generation prompt ends with <think>, as Qwen3's and DeepSeek-R1's do) start the parser inside
it. Streaming holds back only what could still be the closing tag.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
KNOWN_MARKERS = (("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"),
                 ("<|begin_of_thought|>", "<|end_of_thought|>"), ("<think>", "</think>"))


def markers_for(template: str | None) -> tuple[str, str]:
    src = template or ""
    return next(((o, c) for o, c in KNOWN_MARKERS if o in src and c in src), (OPEN, CLOSE))


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def has_thinking_switch(template: str | None) -> bool:
    """Whether the chat template turns thinking on and off by `enable_thinking` (Qwen3's switch,
    which chat_template_kwargs sets)."""
    return "enable_thinking" in (template or "")


def prompt_opens_thinking(prompt_text: str, open_marker: str = OPEN) -> bool:
    return prompt_text.rstrip().endswith(open_marker)


class ReasoningParser:
    def __init__(self, inside: bool = False, markers: tuple[str, str] = (OPEN, CLOSE)) -> None:
        self.open, self.close = markers
        self.state = "inside" if inside else "start"   # start -> inside -> after
        self.buf = ""
        self.strip = False  # the blank lines after </think> are not content

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(self.open):
                self.buf, self.state = head[len(self.open):], "inside"
            elif self.open.startswith(head):
                return out  # could still become the opening tag
            else:
                self.state = "after"
        if self.state == "inside":
            at = self.buf.find(self.close)
            if at < 0:
                keep = next((n for n in range(min(len(self.close) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(self.close[:n])), 0)
                out.reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(self.close):], "after"
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
