r"""The rows of the XML call families (xml_calls.XmlCalls, the Qwen3.5 / Nemotron 3 / StepFun row
itself, reads them all by their markers):

    Qwen3-Coder: as XmlCalls, without thinking; its first call may lack <tool_call>
    Seed-OSS:    <seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></seed:tool_call>
    MiniMax-M2:  <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...
                 </minimax:tool_call>
    MiniCPM5:    <function name="NAME"><param name="KEY">VALUE</param></function>  (VALUE may be CDATA)
    GLM 4.6:     <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>
    GLM 4.7 Flash, Laguna, Spark:  the same without the newlines
    Ling 3.0:    the same, after <role>ASSISTANT</role>; its turn may end with <|role_end|> as text
    Hunyuan 3:   <tool_calls:opensource><tool_call:opensource>NAME<tool_sep:opensource>
                 <arg_key:opensource>KEY</arg_key:opensource><arg_value:opensource>VALUE...

Whitespace after the thinking tags (open_ws, close_ws) is what llama.cpp's template analysis found
for each template, measured against it (tests/engine/chat_formats/test_xml_calls.py).
"""
from __future__ import annotations

from typing import ClassVar

from .base import Context
from .xml_calls import XmlCalls, _Cursor


class Qwen3Coder(XmlCalls):
    """Qwen3-Coder: no thinking; its first call may come without <tool_call>."""
    name = "qwen3_coder"
    think = None
    bare_first = True
    detect_all = ("<tool_call>", "<function=", "<parameter=")

    @classmethod
    def detect(cls, src: str) -> bool:
        return super().detect(src) and "<think>" not in src


class SeedOss(XmlCalls):
    """ByteDance Seed-OSS (llama.cpp's automatic parser)."""
    name = "seed_oss"
    think = ("<seed:think>", "</seed:think>")
    think_ends_at_call, open_ws, close_ws = False, "", "\n"
    wrap = ("<seed:tool_call>", "</seed:tool_call>")
    call = ("<function=", ">", "</function>")
    arg = ("<parameter=", ">", "", "</parameter>")
    flex, string_wins, tail = True, True, "content"
    detect_all = ("<seed:tool_call>", "<function=")


class MiniMaxM2(SeedOss):
    """MiniMax-M2 (automatic parser): several <invoke>s in one <minimax:tool_call>."""
    name = "minimax_m2"
    think = ("<think>", "</think>")
    prompt_think = "<think>\n"
    open_ws, close_ws = "\n", "\n\n"
    section = ("<minimax:tool_call>", "</minimax:tool_call>")
    wrap = ("", "")
    call = ('<invoke name="', '">', "</invoke>")
    arg = ('<parameter name="', '">', "", "</parameter>")
    detect_all = ("<minimax:tool_call>", "<invoke name=")


class MiniCpm5(SeedOss):
    """MiniCPM5: bare <function name="..."> calls; a string value may be a CDATA section."""
    name = "minicpm5"
    think = ("<think>", "</think>")
    prompt_think = "<think>\n"
    open_ws = close_ws = None
    wrap = ("", "")
    call = ('<function name="', '">', "</function>")
    arg = ('<param name="', '">', "", "</param>")
    cdata = ("<![CDATA[", "]]>")
    detect_all = ("Tool usage guidelines:", '<function name="', '<param name="')

    def starts(self, ctx: Context) -> tuple[str, ...]:
        return ("<function",)

    def _raw(self, cur: _Cursor) -> str:
        if cur.at(self.cdata[0]):
            cur.lit(self.cdata[0])
            raw = cur.until(self.cdata[1])
            cur.lit(self.arg[3])
            return raw
        return super()._raw(cur)


class Glm(SeedOss):
    """GLM 4.6 / 4.7 and Laguna (llama.cpp's automatic parser): the name follows <tool_call>."""
    name = "glm"
    think = ("<think>", "</think>")
    prompt_think = "<think>"
    wrap = ("<tool_call>", "</tool_call>")
    call = ("", "", "")
    arg = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    close_ws = ""
    detect_all = ("<tool_call>", "<arg_key>", "<arg_value>")


class Glm46(Glm):
    """GLM 4.6: its template writes a newline after </think>, which llama.cpp's analysis keeps."""
    name = "glm46"
    close_ws = "\n"
    detect_all = (*Glm.detect_all, "'\\n<think></think>'")


class Ling3(XmlCalls):
    """Ling 3.0 (its own parser in llama.cpp): values typed as qwen3_coder's, prose after the
    calls is content, and without reasoning extracted the thinking is content, its tags dropped."""
    name = "ling3"
    think = ("<think>", "</think>")
    prompt_think = "<think>"
    open_ws = close_ws = ""
    wrap = Glm.wrap
    call = Glm.call
    arg = Glm.arg
    flex, tail, stop = True, "content", "<|role_end|>"
    detect_all = ("<role>ASSISTANT</role>", "<arg_key>")

    def _reasoning(self, text: str, ctx: Context, partial: bool, starts: tuple[str, ...]) -> tuple[str, str]:
        if ctx.extract_reasoning or not ctx.thinking_open:
            return super()._reasoning(text, ctx, partial, starts)
        reasoning, rest = super()._reasoning(text, Context(ctx.tools, True, True, ctx.parallel), partial, starts)
        return "", reasoning + rest


class Hy3(SeedOss):
    """Tencent Hunyuan 3 (automatic parser)."""
    name = "hy3"
    think = ("<think:opensource>", "</think:opensource>")
    prompt_think = "<think:opensource>"
    section = ("<tool_calls:opensource>", "</tool_calls:opensource>")
    wrap = ("<tool_call:opensource>", "</tool_call:opensource>")
    call = ("", "<tool_sep:opensource>", "")
    arg = ("<arg_key:opensource>", "</arg_key:opensource>", "<arg_value:opensource>", "</arg_value:opensource>")
    detect_all: ClassVar[tuple[str, ...]] = ("<tool_call{}>", "<arg_key{}>", "<tool_sep{}>")


__all__ = ["Qwen3Coder", "SeedOss", "MiniMaxM2", "MiniCpm5", "Glm", "Glm46", "Ling3", "Hy3"]
