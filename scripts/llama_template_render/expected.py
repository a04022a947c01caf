"""Writes tests/engine/chat_templates/llama_server.json: each template's rendering of each case by
llama.cpp's own code (`render`, built by build.sh), today's date replaced by the placeholders the
test fills in with the day it runs. Every template of the folder (cases.ALL_TEMPLATES, llama.cpp's 70)
gets the cases of cases.CASES; a template that reads `reasoning_effort` (gpt-oss, DeepSeek V4, ...)
also gets EFFORT's, the kwarg set to low and high.

    python scripts/llama_template_render/expected.py /tmp/llama_template_render/render
"""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engine.chat_templates import cases  # noqa: E402


# case -> chat_template_kwargs, for the templates that read reasoning_effort (the user message of thinking_on)
EFFORT = {"reasoning_effort_low": {"reasoning_effort": "low"}, "reasoning_effort_high": {"reasoning_effort": "high"}}


def render(binary: str, name: str, messages: list, tools: list | None, reasoning: int,
           kwargs: dict | None = None) -> str | None:
    """The prompt, or None where llama.cpp refuses the request (llama-server answers an error)."""
    body = {"messages": messages, "bos": cases.BOS, "eos": cases.EOS, "reasoning": reasoning}
    if tools:
        body["tools"] = tools
    if kwargs:
        body["kwargs"] = kwargs
    got = subprocess.run([binary, str(cases.HERE / f"{name}.jinja")], input=json.dumps(body), capture_output=True,
                         text=True)
    if got.returncode == 2:
        print(f"{name}: llama.cpp refuses: {got.stderr.strip()}", file=sys.stderr)
        return None
    got.check_returncode()
    return got.stdout


def main(binary: str) -> None:
    now = datetime.now()
    dates = {now.strftime(fmt): placeholder for fmt, placeholder in cases.DATES.items()}
    out: dict[str, dict[str, str | None]] = {}
    for name in cases.ALL_TEMPLATES:
        out[name] = {}
        todo = {case: (messages, tools, reasoning, None) for case, (messages, tools, reasoning) in cases.CASES.items()}
        if "reasoning_effort" in cases.template(name):
            messages = cases.CASES["thinking_on"][0]
            todo.update({case: (messages, None, -1, kwargs) for case, kwargs in EFFORT.items()})
        for case, (messages, tools, reasoning, kwargs) in todo.items():
            text = render(binary, name, messages, tools, reasoning, kwargs)
            for date, placeholder in dates.items():
                text = text if text is None else text.replace(date, placeholder)
            out[name][case] = text
    cases.EXPECTED.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
