"""What every chat format shares: the parsed message, the request's context, the Format base
class a family module subclasses, and the small text helpers their parsers are made of.

A format reads a reply's whole text so far and says what message it is: `parse(text, ctx,
partial)`. Streaming (`stream.py`) calls it again as text arrives and sends what changed, as
llama-server does (common_chat_parse, then common_chat_msg_diff). So a parser has one rule
to keep: with `partial`, what it returns must be a prefix of what it will return once more text
has come. It holds back text that may still become a marker (`held`), does not type a value
before it is closed, and gives an open call's arguments only as far as they are final.

    reply text --Format.parse--> Parsed(content, reasoning, calls) --stream.diff--> Piece
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping

from ... import jsondepth

THINK = ("<think>", "</think>")


@dataclass
class Call:
    """A tool call read from a reply. `arguments` is a JSON object's text; while `closed` is
    False it is the part written so far that will not change (a prefix of the final text)."""
    name: str
    arguments: str = ""
    closed: bool = True
    id: str | None = None       # the format's own id (Kimi's functions.NAME:0, Mistral's [CALL_ID])


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)


@dataclass(frozen=True)
class Context:
    """What a parser needs of the request: its tools (name -> parameters schema; none: no call
    is read), whether the prompt left the reply inside a thinking block (forced-open thinking),
    whether reasoning is split off (--reasoning-format none keeps it in the content), and
    whether several calls may come."""
    tools: Mapping[str, Any] = field(default_factory=dict)
    thinking_open: bool = False
    extract_reasoning: bool = True
    parallel: bool = True

    def schema(self, tool: str, param: str) -> Any:
        props = (self.tools.get(tool) or {}).get("properties") or {}
        return props.get(param) if isinstance(props, dict) else None


class Format:
    """A family of chat formats. Subclasses set `name`, `detect` and either `calls` (the
    default `parse` splits reasoning off with `think`, then reads calls from the rest) or
    `parse` itself; `markers` are the strings a call may start with (held back while partial)."""
    name: ClassVar[str] = "content"
    think: ClassVar[tuple[str, str] | None] = THINK
    markers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def detect(cls, src: str) -> bool:
        return False

    @property
    def supports_thinking(self) -> bool:
        """Whether the format has reasoning (llama.cpp's supports_thinking): where it has none, a
        template's enable_thinking is off unless the request turns it on, as llama-server sets it."""
        return self.think is not None

    @property
    def reads_calls(self) -> bool:
        """Whether this family reads tool calls (plain content does not)."""
        return type(self).calls is not Format.calls or type(self).parse is not Format.parse

    def messages(self, msgs: list[dict[str, Any]], src: str) -> list[dict[str, Any]]:
        """The messages as the template `src` is given them: a family's rewrite of the request's
        (llama.cpp's workarounds, such as Gemma 4's tool responses folded into the turn); as they are."""
        return msgs

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        reasoning, rest = split_reasoning(text, self.think, ctx, partial)
        if not ctx.tools:
            return Parsed(_content(rest, partial, ()), reasoning)
        content, calls = self.calls(rest, ctx, partial)
        return Parsed(content, reasoning, calls)

    def calls(self, text: str, ctx: Context, partial: bool) -> tuple[str, list[Call]]:
        """(content, calls) of the text after the reasoning; text that is not a call stays content."""
        return _content(text, partial, self.markers), []

    def grammar(self, ctx: Context, choice: str) -> str | None:
        """A Lark grammar (llguidance) whose sentences are calls of the allowed tools (`choice`:
        "required" or a tool's name) in this format, or None where the format has none."""
        return None

    def answer_grammar(self, schema: dict[str, Any], ctx: Context) -> str | None:
        """A response format's grammar (a JSON schema) for the answer, after the reasoning, as
        llama.cpp's: the schema holds the answer, not the thinking; None where the format has no
        reasoning to step over (the schema then holds the whole reply)."""
        if not self.think or not ctx.extract_reasoning:
            return None
        return with_reasoning(f"start: %json {json.dumps(schema)}\n", self.think, ctx.thinking_open)

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return bool(self.think) and prompt.rstrip().endswith(self.think[0])

    def triggers(self, ctx: Context) -> tuple[str, ...]:
        """The strings a call starts with: where `tool_choice: auto`'s lazy grammar begins, as
        llama.cpp's grammar triggers do (none: it begins once a call is read, named)."""
        return tuple(m for m in self.markers if m.strip())

    def call_begins(self, text: str, ctx: Context) -> bool:
        """Whether a reply's text so far has begun a call: a trigger outside the reasoning and
        content (where this family keeps what it could not read as a call), or a call read."""
        marks = self.triggers(ctx)
        if marks and not any(m in text for m in marks):
            return False
        got = self.parse(text, ctx, True)
        return bool(got.calls) or any(text.count(m) > got.reasoning.count(m) + got.content.count(m)
                                      for m in marks)


# --- helpers the families share ---------------------------------------------------------------

def with_reasoning(grammar: str, think: tuple[str, str], inside: bool) -> str:
    """A call grammar (its rule `start`) that lets the model reason first, as llama.cpp's
    grammars do: the thinking block (its opening marker too, unless the prompt opened it) up to
    its closing marker, whitespace, then the calls; or the calls at once. The text ends at the
    closing marker spelled out (a lazy lexeme ends at its first match) or written as a special
    token (a greedy lexeme of bytes, which a special token, having no bytes, ends)."""
    open_, close = think
    body = grammar.replace("start:", "calls_root:", 1)
    head = "" if inside else json.dumps(open_) + " "
    spelled = "".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in close)
    return (f"start: ({head}thought THOUGHT_WS?)? calls_root\n"
            f"thought: thought_spelled | THOUGHT_TEXT? {json.dumps(close)}\n"
            f"thought_spelled[lazy]: /(?s:.*){spelled}/\n"
            "THOUGHT_TEXT: /(?s:.+)/\n"
            "THOUGHT_WS: /[ \\t\\r\\n]+/\n" + body)


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of `text` may still grow into one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def held(text: str, partial: bool, markers: Iterable[str] = ()) -> str:
    """`text` as far as it is final: while partial, without trailing whitespace (a parser may
    strip it at the end) and without a tail that may become a marker."""
    if not partial:
        return text
    text = text[: len(text) - partial_suffix(text, markers)]
    return text.rstrip()


def _content(text: str, partial: bool, markers: Iterable[str]) -> str:
    """Plain text as content, as written (llama.cpp's content parser takes the rest as it is);
    while partial, only as far as it is final."""
    return held(text, partial, markers)


def split_reasoning(text: str, think: tuple[str, str] | None, ctx: Context, partial: bool) -> tuple[str, str]:
    """(reasoning, the rest) of a reply whose thinking block opens at its start, or was opened
    by the prompt (ctx.thinking_open). With reasoning not extracted, all of it is the rest."""
    if not think:
        return "", text
    open_, close = think
    body = text
    if not ctx.thinking_open:
        stripped = text.lstrip()
        if stripped.startswith(open_):
            body = stripped[len(open_):]
        elif partial and stripped and open_.startswith(stripped):
            return "", ""       # may still become the opening tag
        else:
            return "", text
    if not ctx.extract_reasoning:
        return "", text
    at = body.find(close)
    if at < 0:
        return held(body, partial, (close,)).strip(), ""
    return body[:at].strip(), body[at + len(close):].lstrip()


def json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and where it ends, or None; a
    value nested past jsondepth's limit is None too (a model may write any depth; what is
    accepted must encode again and pass through a template's tojson)."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return (value, end) if jsondepth.within(value, jsondepth.MAX_DEPTH) else None


_DECODER = json.JSONDecoder()


def closed_args(args: str) -> str:
    """A cut-off call's arguments (complete members so far, `{"a": 1`) closed into a JSON
    object, or `{}` where they cannot be."""
    for tail in ("}", ""):
        try:
            json.loads(args + tail)
            return args + tail
        except (ValueError, RecursionError):
            pass
    return "{}"


def dump_args(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def open_json(text: str) -> str:
    """The final part of a JSON object's text that is still being written: `text` up to its
    last complete member (at depth 1), so that a streamed call's arguments only ever grow."""
    depth, in_str, esc, last = 0, False, False, 0
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
            if depth == 1:
                last = i + 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 1:
            last = i
    return text[:last]


_WS = re.compile(r"\s*")


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter written as text (the XML formats) typed by its JSON schema, as llama.cpp's
    parsers type it: a parameter that may be a string stays the text unless it reads as one of
    its other types; any other is read as JSON, else kept as text."""
    types = schema_types(schema)
    if types == {"string"} or not types and schema is None:
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    kind = _json_type(value)
    if "string" in types and kind not in types and not (kind == "integer" and "number" in types):
        return raw
    return value


def schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = set(t) if isinstance(t, list) else ({t} if isinstance(t, str) else set())
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out |= schema_types(sub)
    if "enum" in schema and not out:
        out |= {_json_type(v) for v in schema["enum"]}
    if "const" in schema and not out:
        out.add(_json_type(schema["const"]))
    return out


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null"
    return "array" if isinstance(v, list) else "object"
