"""Tool calls parsed from a reply as it streams (the formats are `tools.py`'s).

Content streams; anything that may be a tool call is held back. In the hermes and generic
formats a call is streamed as the model writes it, as OpenAI and llama-server stream theirs:
once the text after `<tool_call>` reads `{"name": "<a tool of the request>",` the call's first
part (its id and name) is sent; once it goes on `"arguments": {`, the arguments' text as it
comes, until the arguments object closes (a scanner follows strings, escapes and nesting; no
parsing, no stack). The closing `}` and `</tool_call>` end it, and the complete call (arguments
parsed and re-serialized, or their text as written when it does not parse within `jsondepth`'s
limit) is given for answers that are not streamed. A call once started stays a call: a reply
cut off inside its arguments ends with the call as far as it got (finish reason "length"), and
arguments that do not stream (a string, another key) are parsed whole at `</tool_call>` and
sent in one part (as written, when they do not parse).

What does not start that way (another key order, an unknown name) is held until
`</tool_call>` and parsed whole, as are the llama3 and mistral formats (held to the end of the
reply when it starts like a call).

Each `Piece` says the same calls twice: `calls`, complete, and `parts`, as they stream.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .. import jsondepth
from .tools import CLOSE, MISTRAL_TAG, OPEN, PYTHON_TAG, new_call_id, parse
from .types import ToolCall, ToolCallPart

NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,')
ARGS_KEY = re.compile(r'\s*"(?:arguments|parameters)"\s*:\s*')
KEYS = ('"arguments"', '"parameters"')
HEAD_LIMIT = 256     # text after <tool_call> without a head: parsed whole at its close instead


@dataclass
class Piece:
    content: str = ""
    calls: tuple[ToolCall, ...] = ()
    parts: tuple[ToolCallPart, ...] = ()


class _Args:
    """The arguments object of a streamed call: its text so far and where its scan stands."""

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index, self.id, self.name = index, call_id, name
        self.text, self.depth, self.in_string, self.escaped = "", 0, False, False

    def take(self, buf: str) -> int:
        """Scan `buf`; the count of its characters that belong to the arguments (all of them
        unless the object closed inside it)."""
        for i, ch in enumerate(buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(buf)

    @property
    def closed(self) -> bool:
        return self.depth == 0 and bool(self.text)

    def call(self) -> ToolCall:
        try:
            args = json.dumps(jsondepth.loads(self.text), ensure_ascii=False) if self.closed else self.text
        except ValueError:
            args = self.text
        return ToolCall(self.id, self.name, args)


class StreamParser:
    """Streams content and tool calls; see the module's docstring."""

    def __init__(self, fmt: str, names: set[str]) -> None:
        self.fmt, self.names = fmt, names
        self.buf = ""
        self.state = "text"          # text | head | named | args | tail | block | named block
        self.args: _Args | None = None
        self.whole = fmt in ("llama3", "mistral")
        self.streaming = False       # whole formats: the reply turned out not to be a call
        self.n_calls = 0

    def feed(self, text: str) -> Piece:
        self.buf += text
        if self.whole:
            return self._feed_whole()
        out = Piece()
        while self._step(out):
            pass
        return out

    def _step(self, out: Piece) -> bool:
        """Consume what the buffer allows in the current state; whether to go on."""
        if self.state == "text":
            at = self.buf.find(OPEN)
            if at < 0:
                keep = _partial_suffix(self.buf, OPEN)
                out.content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            out.content += self.buf[:at]
            self.buf, self.state = self.buf[at + len(OPEN):], "head"
            return True
        if self.state == "head":
            return self._head(out)
        if self.state == "named":
            return self._named()
        if self.state == "args":
            n = self.args.take(self.buf)
            self._stream_args(out, self.buf[:n])
            self.buf = self.buf[n:]
            if self.args.closed:
                self.state = "tail"
            return self.args.closed
        end = self.buf.find(CLOSE)
        if end < 0:
            return False
        block, self.buf = self.buf[:end], self.buf[end + len(CLOSE):]
        if self.state == "tail":
            out.calls += (self.args.call(),)
            self.args = None
        elif self.state == "named block":
            self._named_whole(out, block)
        else:
            self._whole_block(out, OPEN + block + CLOSE)
        self.state = "text"
        return True

    def _head(self, out: Piece) -> bool:
        m = NAME.match(self.buf)
        if m is not None and m.group(1) in self.names:
            self.args = _Args(self.n_calls, new_call_id(), m.group(1))
            self.n_calls += 1
            out.parts += (ToolCallPart(self.args.index, self.args.id, self.args.name),)
            self.buf, self.state = self.buf[m.end():], "named"
            return True
        if m is not None or CLOSE in self.buf or len(self.buf) > HEAD_LIMIT or not _may_head(self.buf):
            self.state = "block"         # not a streamable head: the whole block at its close
            return True
        return False

    def _named(self) -> bool:
        """After the name: the arguments object streams; anything else waits for the close."""
        m = ARGS_KEY.match(self.buf)
        if m is not None and m.end() < len(self.buf):
            if self.buf[m.end()] == "{":
                self.buf, self.state = self.buf[m.end():], "args"
            else:
                self.state = "named block"
            return True
        if CLOSE in self.buf or len(self.buf) > HEAD_LIMIT or not _may_args(self.buf):
            self.state = "named block"
            return True
        return False

    def _named_whole(self, out: Piece, rest: str) -> None:
        """A started call whose arguments did not stream ends at its close with them whole."""
        call = self._salvage(rest)
        out.calls += (call,)
        if call.arguments:
            out.parts += (ToolCallPart(self.args.index, arguments=call.arguments),)
        self.args = None

    def _salvage(self, rest: str) -> ToolCall:
        """The started call with the arguments that `rest` (the text after its name) gives
        parsed whole, else their value as written (a string's text, unquoted)."""
        head = json.dumps({"name": self.args.name})[:-1] + ","
        _, calls = parse(OPEN + head + rest + CLOSE, "hermes", self.names)
        if calls and calls[0].name == self.args.name:
            return ToolCall(self.args.id, self.args.name, calls[0].arguments)
        m = ARGS_KEY.match(rest)
        value = rest[m.end():].strip() if m else ""       # no arguments written (cut off, other keys)
        value = value[:-1].rstrip() if value.endswith("}") else value   # the call's own close
        try:
            got = json.loads(value) if value.startswith('"') else None
        except ValueError:
            got = None
        return ToolCall(self.args.id, self.args.name, got if isinstance(got, str) else value)

    def _stream_args(self, out: Piece, text: str) -> None:
        if text:
            self.args.text += text
            out.parts += (ToolCallPart(self.args.index, arguments=text),)

    def _whole_block(self, out: Piece, block: str) -> None:
        content, calls = parse(block, "hermes", self.names)
        out.content += content if not calls else ""
        for c in calls:
            self._add_whole(out, c)

    def _add_whole(self, out: Piece, c: ToolCall) -> None:
        out.calls += (c,)
        out.parts += (ToolCallPart(self.n_calls, c.id, c.name), ToolCallPart(self.n_calls, arguments=c.arguments))
        self.n_calls += 1

    def _feed_whole(self) -> Piece:
        # a reply that starts like a call is held to the end; anything else streams
        start = self.buf.lstrip()
        markers = (MISTRAL_TAG if self.fmt == "mistral" else "{", PYTHON_TAG)
        if not self.streaming and any(start.startswith(m) or m.startswith(start) for m in markers):
            return Piece()
        self.streaming = True
        out, self.buf = self.buf, ""
        return Piece(out)

    def flush(self) -> Piece:
        """The end of the reply: a call cut off while streaming ends as far as it got; held text
        is parsed whole."""
        text, self.buf = self.buf, ""
        out = Piece()
        if self.state in ("args", "tail"):
            out.calls += (self.args.call(),)
            self.state, self.args = "text", None
            return out
        if self.state in ("named", "named block"):
            self._named_whole(out, text)
            self.state = "text"
            return out
        if self.state in ("head", "block"):
            text = OPEN + text
        self.state = "text"
        if not text:
            return out
        content, calls = parse(text, "hermes" if not self.whole else self.fmt, self.names)
        out.content = content
        for c in calls:
            self._add_whole(out, c)
        return out


def _may_head(text: str) -> bool:
    """Whether `text` (after <tool_call>) can still grow into a streamable head."""
    t = text.lstrip()
    return not t or t[0] == "{"


def _may_args(text: str) -> bool:
    """Whether `text` (after a call's name) can still grow into `"arguments": {`."""
    t = text.lstrip()
    return any(key.startswith(t) or (t.startswith(key) and re.fullmatch(r"\s*(:\s*)?", t[len(key):]))
               for key in KEYS)


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
