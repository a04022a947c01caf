"""Chat templates: the Jinja environment every one is compiled in, and the names
`--chat-template NAME` takes. Both config (which checks `--chat-template` when it is given) and
the engine (which renders, engine/chat.py) read them from here.

The names are llama.cpp's (LLAMA_CPP: every name its `llama_chat_builtin_templates` lists, with
the meaning its `llama_chat_apply_template` gives them, which the engine calls to render them)
and the appliance's own Jinja files (SHIPPED). A file shipped under one of llama.cpp's names
renders every conversation of roles and texts exactly as llama.cpp's does, and takes tools
besides (tests/engine/test_builtin_templates.py holds them together).

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
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest

if TYPE_CHECKING:
    import jinja2

SUFFIX = ".jinja"
SHIPPED = tuple(sorted(f.name.removesuffix(SUFFIX) for f in resources.files(__package__).iterdir()
                       if f.name.endswith(SUFFIX)))
# llama_chat_builtin_templates() of llama-cpp-python 0.3.36's llama.cpp (a test holds them equal)
LLAMA_CPP = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r", "deepseek",
    "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe", "exaone3", "exaone4", "falcon3", "gemma", "gigachat",
    "glmedge", "gpt-oss", "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe",
    "hunyuan-vl", "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3", "llama4",
    "megrez", "minicpm", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken",
    "monarch", "openchat", "orion", "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss", "smolvlm",
    "solar-open", "vicuna", "vicuna-orca", "yandex", "zephyr")
BUILTIN = tuple(sorted(set(SHIPPED) | set(LLAMA_CPP)))
# what ChatTemplate.render and the prompt builder pass themselves; no default kwargs may set them
RENDER_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
REASONING = ("auto", "on", "off")   # llama-server's --reasoning
REASONING_FORMATS = ("auto", "deepseek", "none")   # llama-server's --reasoning-format


class TemplateError(InvalidRequest):
    """The chat template refused these messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the model's chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys, default=_listed)


def _listed(value: Any) -> Any:
    """What tojson makes of a generator (`tools | map(attribute='function') | tojson`): its list."""
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# the ids of the lists and dicts a render was given (its messages, tools and variables), which the
# template may read but not change: set around each render by `given`
GIVEN: ContextVar[frozenset[int]] = ContextVar("template_inputs", default=frozenset())


def given(*values: Any) -> frozenset[int]:
    """The ids of every list and dict reachable from `values`."""
    seen: set[int] = set()
    todo = [v for v in values if isinstance(v, (list, dict, tuple))]
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        todo.extend(x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (list, dict, tuple)))
    return frozenset(seen)


@lru_cache(maxsize=1)
def _lenient_undefined() -> type:
    """jinja2's Undefined, but an empty string where a template adds text to it, as llama.cpp's
    Jinja engine renders `'): ' + param.description` for a parameter without a description
    (jinja2 raises; Command-R+'s tool template does it)."""
    import jinja2

    class Lenient(jinja2.Undefined):
        def __add__(self, other: Any) -> Any:
            return other if isinstance(other, str) else jinja2.Undefined.__add__(self, other)

        def __radd__(self, other: Any) -> Any:
            return other if isinstance(other, str) else jinja2.Undefined.__radd__(self, other)

    return Lenient


@lru_cache(maxsize=1)
def _generation_tag() -> type:
    """Hugging Face's `{% generation %}...{% endgeneration %}` (which marks the assistant's tokens
    for training masks): its body renders as it is, as transformers and llama.cpp render it."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    from jinja2.ext import loopcontrols   # jinja2 on first use: config imports this module
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        """Immutable for what the template is given; its own lists and dicts it may change, as
        llama.cpp's engine lets it (Kimi K2's `ids.append(...)`, `.pop(0)`)."""

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            if isinstance(obj, (list, dict)) and id(obj) not in GIVEN.get():
                return super(ImmutableSandboxedEnvironment, self).is_safe_attribute(obj, attr, value)
            return super().is_safe_attribute(obj, attr, value)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True,
                  extensions=[loopcontrols, _generation_tag()], undefined=_lenient_undefined())
    env.filters["tojson"] = _tojson
    env.filters["safe"] = str   # nothing is escaped here, so "safe" text is plain text (not Markup, whose + escapes)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def by_llama_cpp(template: str | None) -> bool:
    """Whether this template is one of llama.cpp's names that no shipped file renders: the name
    itself stands for it (as llama.cpp's own template argument does), llama.cpp renders it."""
    return template in LLAMA_CPP and template not in SHIPPED


def load_template(spec: str) -> tuple[str, str]:
    """(where it comes from: builtin:NAME or file:PATH, the template) of a built-in name or a
    file's path: a shipped file's Jinja source, or for a name llama.cpp renders the name itself.
    ValueError names what is wrong and lists the built-in names."""
    import jinja2

    if spec in SHIPPED:
        return f"builtin:{spec}", resources.files(__package__).joinpath(spec + SUFFIX).read_text()
    if spec in LLAMA_CPP:
        return f"builtin:{spec}", spec
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


def default_kwargs(kwargs_json: str | None, reasoning: str = "auto") -> dict[str, Any]:
    """The template variables every request gets (a request's own win key by key):
    --chat-template-kwargs' JSON object, with --reasoning on or off as enable_thinking true or
    false (llama-server's default_template_kwargs); the two may not say opposite things.
    ValueError says what is wrong."""
    kwargs: Any = {}
    if kwargs_json:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"chat_template_kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    taken = sorted(RENDER_ARGS & set(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the server passes those")
    if reasoning == "auto":
        return kwargs
    thinking = reasoning == "on"
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise ValueError(f"--reasoning {reasoning} and --chat-template-kwargs enable_thinking "
                         f"{json.dumps(kwargs['enable_thinking'])} say opposite things: give one of them")
    return {**kwargs, "enable_thinking": thinking}
