"""Chat templates: the Jinja environment every one is compiled in, and the ones shipped with the
appliance for `--chat-template NAME`. Both config (which checks `--chat-template` when it is
given) and the engine (which renders, engine/chat.py) read them from here.

The environment is jinja2's immutable sandbox and mirrors what Hugging Face's
`apply_chat_template` gives templates (trim_blocks, lstrip_blocks, loop controls, a `tojson`
that takes `indent`, `raise_exception`, `strftime_now`), so a model's template renders here as
it does there.

The shipped ones, for a model whose GGUF has none, or a wrong one: one Jinja file per format,
taking what Hugging Face templates take (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`; `tools` where the format has them). Roles a format lacks (a tool result under a
format without tools) are rendered as user turns, so the server's generic tool prompt works with
every one of them.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest

if TYPE_CHECKING:
    import jinja2

SUFFIX = ".jinja"
BUILTIN = tuple(sorted(f.name.removesuffix(SUFFIX) for f in resources.files(__package__).iterdir()
                       if f.name.endswith(SUFFIX)))
# what ChatTemplate.render and the prompt builder pass themselves; no default kwargs may set them
RENDER_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


class TemplateError(InvalidRequest):
    """The chat template refused these messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the model's chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    from jinja2.ext import loopcontrols   # jinja2 on first use: config imports this module
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def load_template(spec: str) -> tuple[str, str]:
    """(where it comes from: builtin:NAME or file:PATH, Jinja source) of a built-in name or a
    file's path. ValueError names what is wrong and lists the built-in names."""
    import jinja2

    if spec in BUILTIN:
        return f"builtin:{spec}", resources.files(__package__).joinpath(spec + SUFFIX).read_text()
    path = Path(spec).expanduser()
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat template '{spec}' is neither a built-in one ({', '.join(BUILTIN)}) nor a "
                         f"readable file: {getattr(e, 'strerror', None) or e}") from None
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {path}: line {e.lineno}: {e.message}") from None
    return f"file:{path.resolve()}", source
