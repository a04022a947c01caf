"""Settings declared once, as dataclass fields, and read from command-line flags and APPLIANCE_*
variables. A field made with `opt` holds its help text (and `switch=True` for a mode that is
also an on/off switch, like --prompt-cache; `repeat=True` for a list the flag adds to each time
it is given, like --lora); `add_arguments` gives every field of a class a
flag whose help names its variable and default; `values_of` parses what the flags and an
environment mapping give for a class's fields. config.py declares the settings and hands this
module the environment: it stays the only module that reads it."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any, Mapping

ENV_PREFIX = "APPLIANCE_"


def opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def listed(value: str | None, what: str) -> tuple[str, ...]:
    """A comma-separated list of names (--model-alias a,b, --tags, as llama-server's --alias and
    --tags), in order, each once; ValueError naming the flag `what` for an empty one."""
    if value is None:
        return ()
    got = [n.strip() for n in value.split(",")]
    if not all(got):
        raise ValueError(f"{what} {value!r}: a name is empty (give names separated by commas)")
    return tuple(dict.fromkeys(got))


SWITCH_WORDS = {"1": "on", "true": "on", "yes": "on", "on": "on", "0": "off", "false": "off", "no": "off",
                "off": "off"}


def _parse_value(kind: Any, raw: str, name: str, switch: bool = False, words: Mapping[str, Any] | None = None) -> Any:
    kind = str(kind)
    if words and raw.strip().lower() in words:   # a number that also takes a word: --n-ctx auto
        return words[raw.strip().lower()]
    if switch:  # a mode that is also a switch: --prompt-cache fast, --no-prompt-cache, APPLIANCE_PROMPT_CACHE=0
        return SWITCH_WORDS.get(raw.strip().lower(), raw.strip().lower())
    if "bool" in kind:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: expected a boolean, got {raw!r}")
    try:
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: expected {kind}, got {raw!r}") from None
    return raw


def add_arguments(parser: argparse.ArgumentParser, *classes: type, only: frozenset[str] | None = None) -> None:
    """One flag per field (of `only`'s names, when given); defaults are None so that 'not given'
    falls through to env."""
    for cls in classes:
        group = parser.add_argument_group(cls.__name__.replace("Config", "").lower())
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            env = ENV_PREFIX + f.name.upper()
            default = f"default: {f.default}" if f.default not in (None, "") else "no default"
            help_text = f"{f.metadata['help']} [env {env}; {default}]"
            if f.metadata.get("switch"):
                group.add_argument(flag(f.name), dest=f.name, default=None, nargs="?", const="on",
                                   metavar="MODE", help=help_text)
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const",
                                   const="off", help=argparse.SUPPRESS)
            elif f.metadata.get("repeat"):   # llama-server's --lora: given again, it adds one
                group.add_argument(flag(f.name), dest=f.name, default=None, action="append",
                                   metavar=f.name.upper(), help=help_text)
            elif "bool" in str(f.type):
                group.add_argument(flag(f.name), dest=f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            else:
                group.add_argument(flag(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                                   help=help_text)


def values_of(cls: type, flags: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The fields of `cls` that a flag or a variable gives, parsed to their types; flags win."""
    values = {}
    for f in dataclasses.fields(cls):
        given = flags.get(f.name)
        switch, words = bool(f.metadata.get("switch")), f.metadata.get("words")
        if isinstance(given, list):   # a flag given again (repeat=True): its values, comma-separated
            given = ",".join(given)
        if given is not None:
            values[f.name] = given if not isinstance(given, str) else _parse_value(f.type, given, f.name, switch, words)
        elif ENV_PREFIX + f.name.upper() in env:
            values[f.name] = _parse_value(f.type, env[ENV_PREFIX + f.name.upper()], f.name, switch, words)
    return values
