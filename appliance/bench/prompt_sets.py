"""The named prompt sets that `appliance bench` ships, one per kind of text, and their loader.

Speculative decoding pays off very differently on prose, code, edits to existing code, tool calls,
repetitive output and other languages (BENCHMARKING.md, rule 5), so a bench figure is quoted with
the set it was measured on. Each set is `prompts/<name>.json` inside this package:

    {"name": str, "kind": str, "description": str,
     "prompts": [{"id": str, "messages": [OpenAI chat messages], "tools": [OpenAI tools]?}]}

`load` validates a set as it reads it. `filler.txt` holds original prose paragraphs used to pad a
prompt to a requested context depth (`filler`, `pad_to`); `with_nonce` prefixes a fresh nonce so no
prefix cache can serve a request that is meant to be measured cold (rule 4).
"""
from __future__ import annotations

import copy
import functools
import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

DEFAULT_SETS: tuple[str, ...] = ("prose", "code", "editing-code", "tool-calls", "repetitive",
                                 "multilingual", "long-document")

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_PROMPTS_DIR = "prompts"
_FILLER = "filler.txt"
PAD_INTRO = "Background material:\n\n"
PAD_OUTRO = "\n\nEnd of background material. The request follows.\n\n"


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[dict, ...]          # OpenAI chat messages, as loaded
    tools: tuple[dict, ...] | None      # OpenAI `tools`, or None when the prompt has none


@dataclass(frozen=True)
class PromptSet:
    name: str
    kind: str
    description: str
    prompts: tuple[Prompt, ...]


class UnknownPromptSet(KeyError):
    """No shipped prompt set has this name. The message lists the names that do exist."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(known)
        self.message = f"unknown prompt set {name!r}; known sets: {', '.join(self.known)}"
        super().__init__(self.message)

    def __str__(self) -> str:           # KeyError would show the message in quotes
        return self.message


def _dir():
    return resources.files(__package__).joinpath(_PROMPTS_DIR)


def names() -> list[str]:
    """Every shipped prompt set, sorted."""
    return sorted(entry.name[:-len(".json")] for entry in _dir().iterdir()
                  if entry.is_file() and entry.name.endswith(".json"))


def load(name: str) -> PromptSet:
    """Read and validate the shipped set `name` (ValueError naming the set and prompt if invalid)."""
    known = names()
    if name not in known:
        raise UnknownPromptSet(name, known)
    text = _dir().joinpath(f"{name}.json").read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"prompt set {name!r}: not valid JSON: {e}") from None
    result = parse(data, source=name)
    if result.name != name:
        raise ValueError(f"prompt set {name!r}: file declares the name {result.name!r}")
    return result


def parse(data: Any, source: str | None = None) -> PromptSet:
    """Validate a set already decoded from JSON and build its PromptSet.

    `source` names the set in error messages (the declared name is used when it is None).
    """
    label = source
    if not isinstance(data, Mapping):
        raise ValueError(f"prompt set {label!r}: the top level must be an object")
    if label is None:
        label = data.get("name")
    for key in ("name", "kind", "description"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"prompt set {label!r}: {key!r} must be a non-empty string")
    raw_prompts = data.get("prompts")
    if not isinstance(raw_prompts, list) or not raw_prompts:
        raise ValueError(f"prompt set {label!r}: 'prompts' must be a non-empty list")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_prompts):
        pid = raw.get("id") if isinstance(raw, Mapping) else None
        where = f"prompt set {label!r}, prompt {pid if isinstance(pid, str) else f'#{index}'!r}"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: each prompt must be an object")
        if not isinstance(pid, str) or not pid:
            raise ValueError(f"{where}: 'id' must be a non-empty string")
        if pid in seen:
            raise ValueError(f"{where}: duplicate prompt id")
        seen.add(pid)
        extra = set(raw) - {"id", "messages", "tools"}
        if extra:
            raise ValueError(f"{where}: unexpected keys {sorted(extra)}")
        tools = raw.get("tools")
        try:
            if tools is not None:
                check_tools(tools)
            check_messages(raw.get("messages"), tools)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        prompts.append(Prompt(id=pid, messages=tuple(raw["messages"]),
                              tools=tuple(tools) if tools is not None else None))
    return PromptSet(name=data["name"], kind=data["kind"], description=data["description"],
                     prompts=tuple(prompts))


def check_tools(tools: Any) -> None:
    """Raise ValueError unless `tools` is a valid, non-empty OpenAI function-tool list."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"tool #{i}: must be an object with type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool #{i}: 'function' must be an object with a 'name'")
        if fn["name"] in seen:
            raise ValueError(f"tool {fn['name']!r}: defined twice")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, Mapping) or params.get("type") != "object"):
            raise ValueError(f"tool {fn['name']!r}: 'parameters' must be a JSON schema of type 'object'")


def _text_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return (isinstance(content, list) and bool(content)
            and all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in content))


def check_messages(messages: Any, tools: Any = None) -> None:
    """Raise ValueError unless `messages` is a valid OpenAI chat-completions conversation.

    Checked: roles are known; there is a user message; content is text; assistant tool calls are
    well-formed (JSON-object arguments, a function in `tools` when tools are given); every tool
    message answers a call made by an earlier assistant message, and every call is answered before
    the conversation moves on; the conversation ends with a user or tool message.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    tool_names = ({t["function"]["name"] for t in tools} if tools else None)
    call_ids: set[str] = set()
    pending: set[str] = set()           # calls of the latest assistant turn not yet answered
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message #{i}: must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"message #{i}: invalid role {role!r} (expected one of {sorted(ROLES)})")
        if role != "tool" and pending:
            raise ValueError(f"message #{i}: tool calls {sorted(pending)} were never answered")
        if role == "assistant":
            _check_assistant(i, msg, tool_names, call_ids, pending)
        elif role == "tool":
            _check_tool_result(i, msg, call_ids, pending)
        else:
            _check_text(i, msg, role)
    if pending:
        raise ValueError(f"tool calls {sorted(pending)} were never answered")
    if not any(m.get("role") == "user" for m in messages):
        raise ValueError("there is no user message")
    if messages[-1].get("role") not in ("user", "tool"):
        raise ValueError("the conversation must end with a user or tool message")


def _check_assistant(i: int, msg: Mapping, tool_names: set[str] | None, call_ids: set[str],
                     pending: set[str]) -> None:
    """An assistant turn: text, or tool calls (added to `call_ids` and `pending`), or both."""
    content = msg.get("content")
    calls = msg.get("tool_calls")
    if content is not None and not _text_content(content):
        raise ValueError(f"message #{i}: assistant content must be text or null")
    if calls is None:
        if content is None:
            raise ValueError(f"message #{i}: assistant message has neither content nor tool_calls")
        return
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"message #{i}: 'tool_calls' must be a non-empty list")
    for call in calls:
        _check_call(i, call, tool_names, call_ids)
        call_ids.add(call["id"])
        pending.add(call["id"])


def _check_tool_result(i: int, msg: Mapping, call_ids: set[str], pending: set[str]) -> None:
    """A tool message: the answer to a pending call of the latest assistant turn."""
    ref = msg.get("tool_call_id")
    if not isinstance(ref, str) or ref not in call_ids:
        raise ValueError(f"message #{i}: tool message must reference an earlier tool call id, "
                         f"got {ref!r}")
    if ref not in pending:
        raise ValueError(f"message #{i}: tool call {ref!r} answered twice or out of turn")
    pending.discard(ref)
    if not _text_content(msg.get("content")):
        raise ValueError(f"message #{i}: tool content must be text")


def _check_text(i: int, msg: Mapping, role: str) -> None:
    """A system, developer or user message: non-empty text and no tool fields."""
    content = msg.get("content")
    if not _text_content(content) or not _content_text(content).strip():
        raise ValueError(f"message #{i}: {role} content must be non-empty text")
    if "tool_calls" in msg or "tool_call_id" in msg:
        raise ValueError(f"message #{i}: only assistant and tool messages carry tool fields")


def _check_call(i: int, call: Any, tool_names: set[str] | None, seen_ids: set[str]) -> None:
    if not isinstance(call, Mapping) or call.get("type") != "function":
        raise ValueError(f"message #{i}: each tool call must be an object with type 'function'")
    cid = call.get("id")
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"message #{i}: tool call without an id")
    if cid in seen_ids:
        raise ValueError(f"message #{i}: tool call id {cid!r} used twice")
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"message #{i}: tool call {cid!r} has no function name")
    if tool_names is not None and fn["name"] not in tool_names:
        raise ValueError(f"message #{i}: tool call {cid!r} names {fn['name']!r}, which is not in tools")
    args = fn.get("arguments")
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"message #{i}: tool call {cid!r} arguments must be a JSON object encoded as a string")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


@functools.lru_cache(maxsize=1)
def filler_paragraphs() -> tuple[str, ...]:
    """The paragraphs of filler.txt (split on blank lines, stripped, empty ones dropped)."""
    text = _dir().joinpath(_FILLER).read_text(encoding="utf-8").replace("\r\n", "\n")
    paragraphs = tuple(p.strip() for p in text.split("\n\n") if p.strip())
    if not paragraphs:
        raise ValueError(f"{_FILLER} has no paragraphs")
    return paragraphs


def filler(n_chars: int, seed: int) -> str:
    """At least `n_chars` characters of filler prose, deterministic for `seed`.

    Paragraphs come in an order shuffled by random.Random(seed), joined by blank lines; when every
    paragraph has been used the list is reshuffled and used again (never the same paragraph twice
    in a row). The text stops at the first paragraph boundary at or past n_chars.
    """
    if n_chars <= 0:
        return ""
    paragraphs = filler_paragraphs()
    rng = random.Random(seed)
    out: list[str] = []
    length = 0
    while length < n_chars:
        order = list(paragraphs)
        rng.shuffle(order)
        if out and len(order) > 1 and order[0] == out[-1]:
            order[0], order[-1] = order[-1], order[0]
        for paragraph in order:
            length += len(paragraph) + (2 if out else 0)
            out.append(paragraph)
            if length >= n_chars:
                break
    return "\n\n".join(out)


def _copy_messages(messages: Iterable[Mapping]) -> list[dict]:
    return [copy.deepcopy(dict(m)) for m in messages]


def with_nonce(messages: Iterable[Mapping], nonce: str) -> list[dict]:
    """A deep copy of `messages` whose first message's content starts with f"[{nonce}] "."""
    out = _copy_messages(messages)
    if not out:
        raise ValueError("no messages to prefix")
    first = out[0]
    prefix = f"[{nonce}] "
    content = first.get("content")
    if isinstance(content, list):
        first["content"] = [{"type": "text", "text": prefix}, *content]
    else:
        first["content"] = prefix + (content or "")
    return out


def pad_to(messages: Iterable[Mapping], n_chars: int, seed: int) -> list[dict]:
    """A deep copy of `messages` with filler(n_chars, seed) put before the last user message's content.

    The filler is introduced as background material and closed before the original request, so
    the request still reads sensibly; the message grows by len(filler) plus about 80 characters.
    """
    out = _copy_messages(messages)
    if n_chars <= 0:
        return out
    for msg in reversed(out):
        if msg.get("role") == "user":
            break
    else:
        raise ValueError("no user message to pad")
    head = PAD_INTRO + filler(n_chars, seed) + PAD_OUTRO
    content = msg.get("content")
    if isinstance(content, list):
        msg["content"] = [{"type": "text", "text": head}, *content]
    else:
        msg["content"] = head + (content or "")
    return out
