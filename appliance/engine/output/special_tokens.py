"""A tool-call grammar's markers as the special tokens the model writes them with.

A format's markers (`<|channel|>`, `<|call|>`, `<|tool_call>`...) are single special tokens in
the vocabularies of the models that use them, and llguidance gives a special token no bytes: a
quoted "<|channel|>" in a grammar can only be spelled out character by character, which a model
never does. llguidance names a special token in a rule by its id, `<[200005]>` (any token, whatever
its text looks like). This rewrites each quoted literal of a Lark grammar that holds one into its
text around the token (`"a<|call|>"` -> `("a" <[200012]>)`), leaving %json schemas, /regexes/
and a rule's [attributes] as they are.
"""
from __future__ import annotations

import json
from typing import Callable, Sequence

_DECODER = json.JSONDecoder()


def with_special_tokens(lark: str, specials: Callable[[str], Sequence[tuple[str, int]]]) -> str:
    """`lark` with the special tokens in its quoted literals named as tokens. `specials(text)`
    gives the (text, id) of the special tokens `text` holds, in order (empty: none)."""
    out, i, n = [], 0, len(lark)
    while i < n:
        ch = lark[i]
        if lark.startswith("%json", i):
            start = lark.index("{", i)
            _, end = _DECODER.raw_decode(lark, start)
            out.append(lark[i:end])
            i = end
        elif ch == "/" and (i + 1 < n and lark[i + 1] not in "/"):
            end = _closing(lark, i, "/")
            out.append(lark[i:end])
            i = end
        elif ch == "[" and i and (lark[i - 1].isalnum() or lark[i - 1] == "_"):   # name[lazy]: attributes as they are
            end = _closing(lark, i, "]")
            out.append(lark[i:end])
            i = end
        elif ch == '"':
            end = _closing(lark, i, '"')
            out.append(_literal(lark[i:end], specials))
            i = end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _closing(text: str, i: int, quote: str) -> int:
    """Where the literal opened at `i` ends (after its closing quote)."""
    j = i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _literal(src: str, specials: Callable[[str], Sequence[tuple[str, int]]]) -> str:
    try:
        value = json.loads(src)
    except ValueError:
        return src
    found = specials(value)
    if not found:
        return src
    parts, rest = [], value
    for text, tok in found:
        before, _, rest = rest.partition(text)
        if before:
            parts.append(json.dumps(before, ensure_ascii=False))
        parts.append(f"<[{tok}]>")
    if rest:
        parts.append(json.dumps(rest, ensure_ascii=False))
    return "(" + " ".join(parts) + ")"
