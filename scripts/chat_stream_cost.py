"""What the one streaming core costs a decode step: a long reply (8-16 KB, 2-4k tokens) fed 4
characters at a time (about a token), the reply so far parsed again at each feed as
llama-server does; the best of 3 runs, per feed and in all. docs/api.md quotes it.

    python scripts/chat_stream_cost.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from appliance.engine import chat_formats as cf  # noqa: E402
from appliance.engine.chat_formats.stream import ChatStream  # noqa: E402
from tests.engine.chat_templates import cases  # noqa: E402
tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
prose = ("The quick brown fox jumps over the lazy dog, and then it considers the weather. " * 100)
for name, reply in [("Qwen-Qwen2.5-7B-Instruct", prose + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
                    ("Qwen3.5-4B", prose + "\n</think>\n\n" + prose + "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
                    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>" + prose + "<|end|><|start|>assistant<|channel|>final<|message|>" + prose),
                    ("google-gemma-4-31B-it", "<|channel>thought\n" + prose + "<channel|>" + prose)]:
    fmt = cf.detect(cases.template(name))
    for with_tools in (False, True):
        ctx = cf.Context(tools=tools if with_tools else {}, thinking_open=name == "Qwen3.5-4B")
        best = 1e9
        for _ in range(3):
            s = ChatStream(fmt, ctx)
            t = time.perf_counter()
            for i in range(0, len(reply), 4):
                s.feed(reply[i:i + 4])
            s.flush()
            best = min(best, time.perf_counter() - t)
        n = len(reply) // 4
        print(f"{name:28s} tools={with_tools!s:5s} {len(reply):6d} chars {n:5d} feeds: {1e6*best/n:7.1f} us/feed, {best*1e3:7.1f} ms total")
