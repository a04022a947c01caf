"""Cohere's formats, as llama.cpp reads them:

    Command R7B (automatic parser): <|START_THINKING|>reasoning<|END_THINKING|>
        <|START_RESPONSE|>content<|END_RESPONSE|> or
        <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}, ...]<|END_ACTION|>
    Command R+ (automatic parser): <|CHATBOT_TOKEN|>content<|END_OF_TURN_TOKEN|> or
        Action:\\n```json\\n[{"tool_name": "f", "parameters": {...}}]```
    Cohere2 MoE (common/parsers/cohere2moe.cpp): thinking opened by the prompt, then
        <|START_TEXT|>content<|END_TEXT|> or <|START_ACTION|>[...]<|END_ACTION|>, as R7B's.
"""
from __future__ import annotations

from .base import Context, Parsed
from .json_grammar import Lark, allowed, json_calls, q, reasoning
from .jsoncalls import AutoJson, Cursor, Fail, Short, held_text


class CommandR7B(AutoJson):
    name = "command-r7b"
    needles = ("<|START_ACTION|>", "<|START_RESPONSE|>")
    reasoning = ("<|START_THINKING|>", "<|END_THINKING|>")
    wrap = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
    section = ("<|START_ACTION|>", "<|END_ACTION|>")
    array = True
    order = ("tool_call_id", "tool_name", "parameters")
    id_keys = ("tool_call_id",)


class CommandRPlus(AutoJson):
    name = "command-r-plus"
    needles = ("Action:", "<|CHATBOT_TOKEN|>")
    wrap = ("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
    section = ("Action:\n```json\n", "```")
    array = True
    order = ("tool_name", "parameters")




class Cohere2MoE(CommandR7B):
    """Thinking opened by the prompt, then <|START_TEXT|>content<|END_TEXT|> or the calls."""
    name = "cohere2moe"
    reasoning = ("<|START_THINKING|>", "<|END_THINKING|>")
    wrap = ("<|START_TEXT|>", "<|END_TEXT|>")
    TURN_END = "<|END_OF_TURN_TOKEN|>"

    @classmethod
    def detect(cls, src: str) -> bool:
        return "<|START_TEXT|>" in src and "<|START_ACTION|>" in src

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(self.reasoning[0])

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """The reasoning (no leading whitespace: the parse skips none), then the action right after
        it: content comes only in <|START_TEXT|>...<|END_TEXT|>, which ends the reply."""
        names = allowed(ctx.tools, choice)
        if not names:
            return None
        g = Lark()
        return g.text(f"{reasoning(self, g, ctx, lead=False)} {json_calls(self, g, ctx, names, q(self.section[0]))}")

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        src = self.reasoning[0] + text if ctx.thinking_open else text
        cur, out = Cursor(src), Parsed()
        think_end, (text_start, text_end), action = self.reasoning[1], self.wrap, self.section[0]
        start = 0
        try:
            if cur.lit(self.reasoning[0]):
                body, found = cur.until(think_end, text_start, action)
                body = held_text(body, partial and not found, (think_end, text_start, action))
                if ctx.extract_reasoning:
                    out.reasoning = body
                else:
                    out.content = self.reasoning[0] + body
                if not found:
                    return out
                cur.lit(think_end)
                if not ctx.extract_reasoning and src.startswith(think_end, cur.pos - len(think_end)):
                    out.content += think_end
            start, rest = cur.pos, src[cur.pos:]
            if ctx.tools and len(rest) < len(action) and action.startswith(rest):
                return out
            if ctx.tools and rest.startswith(action):
                self._with_calls(cur, ctx, partial, out)
                return out
            cur.need(text_start)
            body, found = cur.until(text_end)
            out.content += held_text(body, partial and not found, (text_end,))
            if found:
                cur.pos += len(text_end)
                cur.lit(self.TURN_END)
                if cur.pos < len(src):
                    raise Fail
        except Short:
            pass
        except Fail:
            out.content += held_text(src[start:], partial)        # llama.cpp throws: the rest stays content
        return out


FAMILIES = [CommandR7B, CommandRPlus]
