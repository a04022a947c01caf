"""Writes tests/engine/chat_templates/llama_chat.json: llama.cpp's own reading of model replies, for each
of the 70 templates of llama.cpp's models/templates/ (copied into tests/engine/chat_templates/).

Binaries (scripts/llama_chat_reference/build.sh L BUILD_DIR harvest, L = the sdist's vendor/llama.cpp):
  BUILD_DIR/chat_ref  apply + parse as llama-server does them (chat_ref.cpp), a JSON line in, a JSON line out
  BUILD_DIR/harvest   llama.cpp's tests/test-chat.cpp, patched (harvest_patch.py) to write each template case

    python scripts/llama_chat_reference/record.py BUILD_DIR L

Per template the fixture holds
  "format":  the common_chat_format llama.cpp picks for a request with tools
  "apply":   the facts of the main requests (plain / tools, and thinking off where the template thinks):
             format, generation_prompt, grammar_lazy, grammar_triggers, preserved_tokens, additional_stops,
             supports_thinking, thinking_start_tag, thinking_end_tags (the grammar itself is left out: size)
  "turn_end": what the template writes after an assistant message's content (an end-of-generation token
             and the template's own separator: not part of a reply)
  "cases":   parse cases {source, name, request, reply, partial, format, generation_prompt, message}
             - source "test-chat": every case test-chat.cpp runs through peg_test_builder::run(), its input
               the reply; "expected" is what the test states (a full message: the fields no expect_* set
               are expected empty; content and reasoning compared whitespace-stripped, arguments as JSON),
               "test_error" the test's own failure, if any
             - source "generated": a reply in the model's own format, got by rendering a conversation
               that ends with the assistant message through llama.cpp and taking what follows the
               generation prompt, less the turn end; "intended" is that assistant message
             "message" is chat_ref's actual output (the fixture's authority), or "error" where llama.cpp
             throws. "request" holds what chat_ref was sent, less the template path ("template" is the
             file name without .jinja, in tests/engine/chat_templates/).
  "skipped": generated cases that could not be made, with the reason
  "tools_refused": the tools of TOOLS llama.cpp refuses for this template (the others are used), where any
A generated case whose generation prompt opens a thinking block that the rendered history does not show
(forced-open thinking, the assistant message having no reasoning) is made with thinking off instead; where
that does not render either (the prompt opens the block whatever the request), its reply is put together
("made": "forced-open: ...", the others "rendered"): the assistant message's reasoning (or nothing), the
template's thinking end tag, the whitespace the template writes after it in a message that has reasoning
(none where its history drops reasoning), and the assistant turn as the history renders it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engine.chat_templates import cases  # noqa: E402

OUT = cases.HERE / "llama_chat.json"


def _tool(name: str, description: str, properties: dict | None, required: list[str] | None = None) -> dict:
    fn: dict = {"name": name, "description": description}
    if properties is not None:
        fn["parameters"] = {"type": "object", "properties": properties, "required": required or []}
    return {"type": "function", "function": fn}


TOOLS = [
    _tool("get_weather", "The current weather in a city",
          {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("add", "Adds two numbers", {"a": {"type": "integer"}, "b": {"type": "number"}}, ["a", "b"]),
    _tool("set_flags", "Sets flags",
          {"on": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
           "meta": {"type": "object"}}, ["on", "tags", "meta"]),
    _tool("ping", "Checks that the service is up", None),
]

NESTED = {"on": True, "tags": ["ünïcödé", "日本語", 'say "hi"'],
          "meta": {"note": "line1\nline2 ✓", "n": -3, "x": 1.25, "ok": False, "list": [1, "two", None],
                   "deep": {"k": "v"}}}
IDS = ["a1b2c3d4e", "f5g6h7i8j"]   # Mistral's templates take only ids of 9 letters and digits


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": IDS[i], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


USER = [{"role": "user", "content": "Please help me with this."}]
# name -> (assistant message, request fields beyond the conversation)
GENERATED: dict[str, tuple[dict, dict]] = {
    "one_call": ({"content": "", "tool_calls": [_call(0, "get_weather", {"city": "Paris", "unit": "celsius"})]},
                 {"tools": TOOLS}),
    "two_calls": ({"content": "", "tool_calls": [_call(0, "get_weather", {"city": "Paris"}),
                                                 _call(1, "add", {"a": 2, "b": 3.5})]},
                  {"tools": TOOLS, "parallel_tool_calls": True}),
    "nested_unicode_args": ({"content": "", "tool_calls": [_call(0, "set_flags", NESTED)]}, {"tools": TOOLS}),
    "empty_args": ({"content": "", "tool_calls": [_call(0, "ping", {})]}, {"tools": TOOLS}),
    "content_then_call": ({"content": "Let me check the weather.",
                           "tool_calls": [_call(0, "get_weather", {"city": "Berlin"})]}, {"tools": TOOLS}),
    "reasoning_then_call": ({"content": "", "reasoning_content": "The user wants the weather, so I call the tool.",
                             "tool_calls": [_call(0, "get_weather", {"city": "Tokyo"})]}, {"tools": TOOLS}),
    "plain": ({"content": "The answer is 4."}, {"tools": TOOLS}),
    "plain_no_tools": ({"content": "The answer is 4."}, {}),
    "reasoning_then_plain": ({"content": "The answer is 4.", "reasoning_content": "2+2 is basic arithmetic."},
                             {"tools": TOOLS}),
    # where the template thinks: the same answer with thinking off
    "plain_thinking_off": ({"content": "The answer is 4."}, {"tools": TOOLS, "enable_thinking": False}),
}
PROBE = "Zq7-PROBE-END-OF-CONTENT"
# end-of-generation tokens that end a reply: the model stops on them, they are not part of its text
EOG = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|return|>", "<|call|>", "<|calls|>", "</s>", "<|endoftext|>",
       "<end_of_turn>", "<turn|>", "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>", "<|end_of_text|>", "<seed:eos>",
       "<|end_of_msg|>", "<end_of_sentence>", "[e~[", "<SPECIAL_12>", "<sep>", "<|role_end|>", "<|eot|>",
       "</assistant>", "<｜hy_eos:opensource｜>"]
# ones that also separate messages inside a reply (gpt-oss's analysis and final, GigaChat's content and call):
# a turn end only at the end
TRAILING = ["<|end|>", "<|message_sep|>"]
FACT_KEYS = ["format", "generation_prompt", "grammar_lazy", "grammar_triggers", "preserved_tokens",
             "additional_stops", "supports_thinking", "thinking_start_tag", "thinking_end_tags"]


class ChatRef:
    """chat_ref, kept running: one request in, one answer out."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.proc: subprocess.Popen | None = None

    def __call__(self, request: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([self.binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
        body = dict(request, template=str(cases.HERE / f"{request['template']}.jinja"))
        self.proc.stdin.write(json.dumps(body, ensure_ascii=False) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            return {"error": "chat_ref died on this request", "error_stage": "crash"}
        return json.loads(line)


def dated(text: str) -> str:
    """Today's date as the placeholders of cases.py (a template's strftime_now)."""
    now = datetime.now()
    for fmt, placeholder in cases.DATES.items():
        text = text.replace(now.strftime(fmt), placeholder)
    return text


def facts(got: dict) -> dict:
    if "error" in got and "format" not in got:
        return {"error": got["error"]}
    out = {k: got[k] for k in FACT_KEYS}
    out["generation_prompt"] = dated(out["generation_prompt"])
    return out


def result(got: dict) -> dict:
    """A case's answer: the format and generation prompt its request got, and the message or the error."""
    out: dict = {}
    if "format" in got:
        out["format"] = got["format"]
        out["generation_prompt"] = dated(got["generation_prompt"])
    if "error" in got:
        out["error"] = got["error"]
        out["error_stage"] = got["error_stage"]
    else:
        out["message"] = got["message"]
    return out


def base(name: str) -> dict:
    return {"template": name, "bos": "", "eos": ""}


def turn_end(ref: ChatRef, name: str) -> str | None:
    """What the template writes after an assistant message's content."""
    got = ref(dict(base(name), messages=USER + [{"role": "assistant", "content": PROBE}], add_generation_prompt=False))
    if "error" in got or PROBE not in got["prompt"]:
        return None
    return got["prompt"].split(PROBE, 1)[1]


def strip_end(rest: str, end: str | None) -> tuple[str, str]:
    """The reply, less what the template wrote after it (and that tail): the model stops at its first
    end-of-generation token (EOG); failing one, a turn end that starts with a TRAILING token goes."""
    cut = min((i for i in (rest.find(t) for t in EOG) if i >= 0), default=-1)
    if cut >= 0:
        return rest[:cut], rest[cut:]
    if end and rest.endswith(end) and any(end.strip().startswith(t) for t in TRAILING):
        return rest[:len(rest) - len(end)], end
    body = rest.rstrip()
    for tok in TRAILING:
        if body.endswith(tok):
            return body[:len(body) - len(tok)], rest[len(body) - len(tok):]
    return rest, ""


def same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a or "{}") == json.loads(b or "{}")
    except ValueError:
        return False


def roundtrips(intended: dict, message: dict) -> bool:
    calls = intended.get("tool_calls") or []
    return (message["content"].strip() == intended.get("content", "").strip()
            and message["reasoning_content"].strip() == intended.get("reasoning_content", "").strip()
            and len(message["tool_calls"]) == len(calls)
            and all(m["name"] == c["function"]["name"] and same_json(m["arguments"], c["function"]["arguments"])
                    for m, c in zip(message["tool_calls"], calls)))


def usable_tools(ref: ChatRef, name: str) -> tuple[list, dict]:
    """TOOLS, less any llama.cpp refuses for this template (where it refuses the whole set), and why."""
    if "error" not in ref(dict(base(name), messages=USER, tools=TOOLS)):
        return TOOLS, {}
    dropped = {}
    for tool in TOOLS:
        got = ref(dict(base(name), messages=USER, tools=[tool]))
        if "error" in got:
            dropped[tool["function"]["name"]] = got["error"]
    return [t for t in TOOLS if t["function"]["name"] not in dropped], dropped


def after_thinking(ref: ChatRef, request: dict, end_tag: str) -> str:
    """The whitespace the template writes between the thinking end tag and the content of a message with
    both ("" where its history shows no reasoning, or writes more than whitespace there)."""
    got = ref(dict(request, messages=request["messages"] + [{"role": "assistant", "content": PROBE,
                                                             "reasoning_content": "Zq7-R"}],
                   add_generation_prompt=False))
    text = got.get("prompt", "")
    i = text.rfind("Zq7-R" + end_tag)
    j = text.find(PROBE, i) if i >= 0 else -1
    between = text[i + len("Zq7-R" + end_tag):j] if j >= 0 else ""
    return between if not between.strip() else ""


def reply_of(ref: ChatRef, request: dict, assistant: dict, end: str | None,
             forced: bool = False) -> tuple[dict | None, str, str]:
    """(the generation-prompt answer, the reply, the turn end stripped) or (None, why not, "")."""
    full = ref(dict(request, messages=request["messages"] + [assistant], add_generation_prompt=False))
    head = ref(dict(request, add_generation_prompt=True))
    if "error" in head:
        return None, f"llama.cpp refuses the request: {head['error']}", ""
    if "error" in full:
        return None, f"llama.cpp refuses to render the assistant message: {full['error']}", ""
    prefix, text = head["prompt"], full["prompt"]
    head["made"] = "rendered"
    if not text.startswith(prefix):
        n = next((i for i, (a, b) in enumerate(zip(prefix, text)) if a != b), min(len(prefix), len(text)))
        start, ends = head["thinking_start_tag"], head["thinking_end_tags"]
        n = prefix.rstrip().rfind(start) if start else -1
        if forced and ends and n >= 0 and prefix[n:].strip() == start.strip() and text.startswith(prefix[:n]):
            # the prompt leaves the reply inside a thinking block the history does not show: a model
            # writes its reasoning (maybe none), the closing tag, then what the history shows
            reply, stripped = strip_end(text[n:], end)
            reply = assistant.get("reasoning_content", "") + ends[0] + after_thinking(ref, request, ends[0]) \
                + reply.lstrip()
            head["made"] = "forced-open: reasoning + thinking end tag + the rendered turn"
            why = lacking(assistant, reply)
            return (None, why, "") if why else (head, reply, stripped)
        return None, ("the generation prompt is not a prefix of the rendered history: prompt ..."
                      + json.dumps(prefix[max(0, n - 30):n + 30], ensure_ascii=False) + ", history ..."
                      + json.dumps(text[max(0, n - 30):n + 30], ensure_ascii=False)), ""
    reply, stripped = strip_end(text[len(prefix):], end)
    why = lacking(assistant, reply)
    return (None, why, "") if why else (head, reply, stripped)


def lacking(assistant: dict, reply: str) -> str:
    """Why the reply does not carry the assistant message ("" where it does)."""
    missing = [what for what, value in (("reasoning_content", assistant.get("reasoning_content")),
                                        ("content", assistant.get("content")))
               if value and value not in reply]
    missing += [f"call {c['function']['name']}" for c in assistant.get("tool_calls", [])
                if c["function"]["name"] not in reply]
    if missing:
        return f"the rendered assistant turn lacks its {', '.join(missing)}: " + json.dumps(reply, ensure_ascii=False)
    return ""


def generated(ref: ChatRef, name: str, supports_thinking: bool, end: str | None,
              tools: list, dropped: dict) -> tuple[list, list]:
    out, skipped = [], []
    for case, (assistant, extra) in GENERATED.items():
        if case == "plain_thinking_off" and not supports_thinking:
            continue
        assistant = dict(role="assistant", **assistant)
        lacking = sorted({c["function"]["name"] for c in assistant.get("tool_calls", [])} & set(dropped))
        if lacking:
            skipped.append({"name": case, "reason": f"llama.cpp refuses the tool {', '.join(lacking)} here"})
            continue
        request = dict(base(name), messages=USER, **extra)
        if "tools" in request:
            request["tools"] = tools
        head, reply, stripped = reply_of(ref, request, assistant, end)
        if head is None and supports_thinking and "enable_thinking" not in request \
                and not assistant.get("reasoning_content") and "not a prefix" in reply:
            # a generation prompt that opens a thinking block the history does not show: thinking off
            first = reply
            request = dict(request, enable_thinking=False)
            head, reply, stripped = reply_of(ref, request, assistant, end)
            if head is None:
                reply = f"{first}; with thinking off: {reply}"
        if head is None and "not a prefix" in reply:
            request = dict(base(name), messages=USER, **extra)
            if "tools" in request:
                request["tools"] = tools
            head, reply, stripped = reply_of(ref, request, assistant, end, forced=True)
        if head is None:
            skipped.append({"name": case, "reason": reply})
            continue
        request = dict(request, enable_thinking=head["inputs"]["enable_thinking"],
                       parallel_tool_calls=head["inputs"]["parallel_tool_calls"])
        got = ref(dict(request, reply=reply, partial=False))
        entry = {"source": "generated", "name": case, "request": request, "reply": reply, "partial": False,
                 "made": head["made"], "turn_end": stripped, **result(got),
                 "intended": {k: assistant[k] for k in ("content", "reasoning_content", "tool_calls") if k in assistant}}
        if "message" in entry:
            entry["roundtrips"] = roundtrips(assistant, entry["message"])
        out.append(entry)
    return out, skipped


def harvested(harvest: str, llama: str) -> list[dict]:
    """test-chat.cpp's template cases, in its order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cases.jsonl")
        run = subprocess.run([harvest], cwd=llama, env=dict(os.environ, HARVEST_OUT=path),
                             capture_output=True, text=True)
        print(f"test-chat (patched) exit {run.returncode}", file=sys.stderr)
        if run.returncode:
            print(run.stderr[-2000:], file=sys.stderr)
        return [json.loads(line) for line in open(path, encoding="utf-8")]


def from_test_chat(ref: ChatRef, records: list[dict]) -> dict[str, list]:
    out: dict[str, list] = {}
    for rec in records:
        name = rec["template"]
        request = dict(base(name), messages=rec["messages"], tool_choice=rec["tool_choice"],
                       parallel_tool_calls=rec["parallel_tool_calls"], reasoning_format=rec["reasoning_format"],
                       enable_thinking=rec["enable_thinking"], add_generation_prompt=rec["add_generation_prompt"])
        if rec["tools"]:
            request["tools"] = rec["tools"]
        if rec["chat_template_kwargs"]:
            request["kwargs"] = rec["chat_template_kwargs"]
        if rec["continue_final_message"] != "none":
            request["continue_final_message"] = \
                True if rec["continue_final_message"] == "auto" else rec["continue_final_message"]
        if rec["json_schema"] is not None:
            request["json_schema"] = rec["json_schema"]
        got = ref(dict(request, reply=rec["input"], partial=rec["is_partial"]))
        mine = out.setdefault(name, [])
        mine.append({"source": "test-chat", "name": f"test-chat {len(mine) + 1}", "request": request,
                     "reply": rec["input"], "partial": rec["is_partial"], **result(got),
                     "expected": rec["expect"], "expect_setters": rec["expect_setters"],
                     "test_error": rec["test_error"]})
    return out


def main(build: str, llama: str) -> None:
    ref = ChatRef(os.path.join(build, "chat_ref"))
    tests = from_test_chat(ref, harvested(os.path.join(build, "harvest"), llama))
    fixture: dict[str, dict] = {}
    for name in cases.ALL_TEMPLATES:
        usable, dropped = usable_tools(ref, name)
        plain = ref(dict(base(name), messages=USER))
        tools = ref(dict(base(name), messages=USER, tools=usable))
        apply = {"plain": facts(plain), "tools": facts(tools)}
        thinks = bool(plain.get("supports_thinking") or tools.get("supports_thinking"))
        if thinks:
            apply["plain_thinking_off"] = facts(ref(dict(base(name), messages=USER, enable_thinking=False)))
            apply["tools_thinking_off"] = facts(ref(dict(base(name), messages=USER, tools=usable, enable_thinking=False)))
        end = turn_end(ref, name)
        gen, skipped = generated(ref, name, thinks, end, usable, dropped)
        fixture[name] = {"format": tools.get("format"), "apply": apply, "turn_end": end,
                         **({"tools_refused": dropped} if dropped else {}),
                         "cases": tests.get(name, []) + gen, "skipped": skipped}
        print(f"{name}: {tools.get('format')} test-chat {len(tests.get(name, []))} generated {len(gen)} "
              f"skipped {len(skipped)}", file=sys.stderr)
    unknown = sorted(set(tests) - set(fixture))
    if unknown:
        print(f"test-chat cases for templates not in the folder: {unknown}", file=sys.stderr)
    OUT.write_text(dump(fixture))


def dump(fixture: dict) -> str:
    """The fixture as JSON, a template's field or a case to a line (diffs stay readable, the file small)."""
    one = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
    out = []
    for name, entry in fixture.items():
        fields = []
        for key, value in entry.items():
            if key in ("cases", "skipped", "apply") and value:
                items = value.items() if key == "apply" else value
                body = ",\n".join(f"   {one(k)}: {one(v)}" for k, v in items) if key == "apply" \
                    else ",\n".join(f"   {one(v)}" for v in items)
                fields.append(f"  {one(key)}: " + ("{\n" if key == "apply" else "[\n") + body
                              + ("\n  }" if key == "apply" else "\n  ]"))
            else:
                fields.append(f"  {one(key)}: {one(value)}")
        out.append(f" {one(name)}: {{\n" + ",\n".join(fields) + "\n }")
    return "{\n" + ",\n".join(out) + "\n}\n"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
