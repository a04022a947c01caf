"""What a template says of reasoning: the markers it names (a known pair: [THINK]...[/THINK] for
Magistral, <seed:think> for Seed-OSS, ...; else <think>...</think>) for a format with no
markers of its own, and whether it has Qwen3's enable_thinking switch. The reasoning itself is
read by the reply's format (chat_formats/)."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
KNOWN_MARKERS = (("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"),
                 ("<|begin_of_thought|>", "<|end_of_thought|>"), ("<think>", "</think>"))


def markers_for(template: str | None) -> tuple[str, str]:
    src = template or ""
    return next(((o, c) for o, c in KNOWN_MARKERS if o in src and c in src), (OPEN, CLOSE))


def has_thinking_switch(template: str | None) -> bool:
    """Whether the chat template turns thinking on and off by `enable_thinking` (Qwen3's switch,
    which chat_template_kwargs sets)."""
    return "enable_thinking" in (template or "")
