"""DeepSeek's formats, as llama.cpp reads them:

    V3.1 (automatic parser):  <think>reasoning</think>content<｜tool▁calls▁begin｜>
                              <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    R1 distills, llama.cpp's R1 template (automatic parser): the same section, each call
                              <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}```<｜tool▁call▁end｜>;
                              thinking opened by the generation prompt ("<think>\\n"). The Llama distill's
                              template takes no calls: llama.cpp reads content and reasoning only.
    V3.2 / V4 (common/parsers/deepseek.cpp, dsml.py): DSML markup.
"""
from __future__ import annotations

from .jsoncalls import AutoJson

SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")


class DeepSeekV31(AutoJson):
    name = "deepseek-v3.1"
    needles = ("<｜tool▁calls▁begin｜>", "'<｜tool▁sep｜>' + tool['function']['arguments']")
    reasoning = ("<think>", "</think>")
    tools = "tag"
    section, per_call = SECTION, CALL
    name_suffix = "<｜tool▁sep｜>"


class DeepSeekR1(DeepSeekV31):
    name = "deepseek-r1"
    needles = ("<｜tool▁calls▁begin｜>", "'```json'")
    opened = "<think>\n"
    name_prefix = "function<｜tool▁sep｜>"
    name_suffix = "\n```json\n"
    close = "```"


class DeepSeekR1NoCalls(DeepSeekR1):
    name = "deepseek-r1-distill-llama"
    needles = ("<｜tool▁calls▁begin｜>", "message['content'] is none")
    tools = None


FAMILIES = [DeepSeekR1NoCalls, DeepSeekR1, DeepSeekV31]
