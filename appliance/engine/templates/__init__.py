"""Chat templates shipped with the appliance, for `--chat-template NAME` (a model whose GGUF has
none, or a wrong one): one Jinja file per format, taking what Hugging Face templates take
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`; `tools` where the format has
them). Roles a format lacks (a tool result under a format without tools) are rendered as user
turns, so the server's generic tool prompt works with every one of them.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIX = ".jinja"
BUILTIN = tuple(sorted(f.name.removesuffix(SUFFIX) for f in resources.files(__package__).iterdir()
                       if f.name.endswith(SUFFIX)))
# what ChatTemplate.render and the prompt builder pass themselves; no default kwargs may set them
RENDER_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def load_template(spec: str) -> tuple[str, str]:
    """(where it comes from: builtin:NAME or file:PATH, Jinja source) of a built-in name or a
    file's path. ValueError names what is wrong and lists the built-in names."""
    import jinja2

    from ..chat import compile_template

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
