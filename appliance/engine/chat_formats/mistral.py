"""Mistral's formats, as llama.cpp reads them:

    Mistral Small 3.2:  [TOOL_CALLS]f[CALL_ID]id[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}   (the id optional)
    Devstral:           [TOOL_CALLS]f[ARGS]{...}
    Mistral Nemo:       [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "123456789"}, ...]
                        (these three: jsoncalls.AutoJson rows of llama.cpp's automatic parser)
    Ministral 3 / Magistral (common/parsers/ministral3.cpp): [THINK]reasoning[/THINK] then
                        content, then [TOOL_CALLS]f[ARGS]{...} repeated
"""
from __future__ import annotations

from .base import Context, Parsed
from .jsoncalls import AutoJson, Cursor, Short, held_text


class MistralSmall(AutoJson):
    name = "mistral-small-3.2"
    needles = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    tools = "tag"
    per_call = ("[TOOL_CALLS]", "")
    call_id = ("[CALL_ID]", "[ARGS]")


class Devstral(AutoJson):
    name = "devstral"
    needles = ("[TOOL_CALLS]", "[ARGS]")
    tools = "tag"
    per_call = ("[TOOL_CALLS]", "")
    name_suffix = "[ARGS]"


class MistralNemo(AutoJson):
    name = "mistral-nemo"
    needles = ("[TOOL_CALLS]",)
    section = ("[TOOL_CALLS]", "")
    array = True
    order = ("name", "arguments", "id")
    id_keys = ("id",)


class Ministral3(Devstral):
    """[THINK]...[/THINK], content, then calls; llama.cpp reads no further than the last call."""
    name = "ministral3"
    reasoning = ("[THINK]", "[/THINK]")

    @classmethod
    def detect(cls, src: str) -> bool:
        return all(m in src for m in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return False

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        cur, out = Cursor(text), Parsed()
        if ctx.extract_reasoning:
            try:
                if cur.lit("[THINK]"):
                    body, found = cur.until("[/THINK]")
                    if not found:
                        out.reasoning = held_text(body, partial, ("[/THINK]",))
                        return out
                    out.reasoning = body
                    cur.pos += len("[/THINK]")
            except Short:
                return out
        cur.space()
        if not ctx.tools:
            out.content = held_text(text[cur.pos:], partial)
            return out
        self._with_calls(cur, ctx, partial, out)
        return out


FAMILIES = [MistralSmall, MistralNemo]   # Devstral: Ministral3 (llama.cpp detects it so)
