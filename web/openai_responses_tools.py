"""The Responses API's `tools` and `tool_choice`, as the OpenAI chat request's function tools.

- `function` tools are offered as they are.
- `namespace` tools (Codex groups its multi-agent functions and each MCP server's tools in one)
  offer each function inside under the flat name `{namespace}__{name}` (vLLM's choice, a name
  every template and grammar takes: OpenAI's function names allow letters, digits, `_` and `-`),
  its description after the namespace's. A call the model makes to a flat name comes back as
  OpenAI writes it: `name` the function's own name and `namespace` beside it, and an earlier
  turn's call item with a `namespace` goes back into the prompt under the flat name.
- Tools that OpenAI's service runs itself (web and file search, code interpreter, image
  generation, remote MCP, computer use, the built-in shell and patch tools, tool search) cannot
  run here: they are left out of the prompt, never a failure (Codex sends `web_search` with every
  request), and the Response's `tools` echoes only the tools the model was offered.
- `custom` tools (free-form text input, Codex's apply_patch for the models it knows) are offered
  as a function of one string argument, `input`; their grammar `format` (lark or regex) is
  written into the description for the model to follow, not enforced. A call comes back as a
  `custom_tool_call` item with its `input`, and an earlier turn's call and output go back into
  the prompt as a call of that function and its result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import serving

SEP = "__"
# run by OpenAI's service, or calls of item types only OpenAI's models write
HOSTED = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
          "file_search", "code_interpreter", "image_generation", "mcp", "computer", "computer_use_preview",
          "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling")


@dataclass
class Offered:
    """What the model is offered, and how to name its calls back."""
    tools: list[dict[str, Any]] = field(default_factory=list)          # OpenAI chat function tools
    echo: list[dict[str, Any]] = field(default_factory=list)           # the request's tools that were offered
    left_out: list[str] = field(default_factory=list)                  # hosted tool types left out
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)   # flat name -> (namespace, name)
    custom: set[str] = field(default_factory=set)                      # flat names of custom tools

    def call_name(self, flat_name: str) -> dict[str, str]:
        """A call's item type, `name` (and `namespace`) as the Responses API writes them."""
        kind = "custom_tool_call" if flat_name in self.custom else "function_call"
        if flat_name in self.namespaces:
            namespace, name = self.namespaces[flat_name]
            return {"type": kind, "name": name, "namespace": namespace}
        return {"type": kind, "name": flat_name}


def flat(namespace: Any, name: str) -> str:
    """The name a function of `namespace` (None: none) has in the prompt."""
    return f"{namespace}{SEP}{name}" if namespace else name


def _function(t: dict[str, Any], where: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    serving.need(isinstance(t.get("name"), str) and t["name"], f"{where}.name must be a non-empty string",
                 f"{where}.name")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    if namespace is not None:
        fn["name"] = flat(namespace["name"], t["name"])
        about = [d for d in (namespace.get("description"), t.get("description")) if isinstance(d, str) and d]
        if about:
            fn["description"] = "\n".join(about)
    return {"type": "function", "function": fn}


def _custom(t: dict[str, Any], where: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """A custom tool as a function of one string, `input` (its grammar in the description)."""
    fmt = t.get("format") or {"type": "text"}
    serving.need(isinstance(fmt, dict) and fmt.get("type") in ("text", "grammar"),
                 f"{where}.format.type must be text or grammar", f"{where}.format.type")
    about = t.get("description") if isinstance(t.get("description"), str) else ""
    if fmt["type"] == "grammar":
        serving.need(fmt.get("syntax") in ("lark", "regex") and isinstance(fmt.get("definition"), str),
                     f"{where}.format needs a syntax (lark or regex) and a definition", f"{where}.format")
        about += f"\n\nThe input follows this {fmt['syntax']} grammar:\n{fmt['definition']}"
    fn = {"name": t.get("name"), "description": about.strip(), "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "description": "the tool's free-form input"}},
        "required": ["input"], "additionalProperties": False}}
    return _function(fn, where, namespace)


def _namespace(t: dict[str, Any], where: str, out: Offered) -> None:
    serving.need(isinstance(t.get("name"), str) and t["name"] and SEP not in t["name"],
                 f"{where}.name must be a non-empty string without '{SEP}'", f"{where}.name")
    inner = t.get("tools")
    serving.need(isinstance(inner, list), f"{where}.tools must be a list of function tools", f"{where}.tools")
    for j, fn in enumerate(inner):
        at = f"{where}.tools[{j}]"
        kind = fn.get("type") if isinstance(fn, dict) else None
        serving.need(kind in ("function", "custom"), f"{at}.type must be function or custom (got {kind!r})",
                     f"{at}.type")
        tool = _function(fn, at, t) if kind == "function" else _custom(fn, at, t)
        name = tool["function"]["name"]
        serving.need(name not in out.namespaces, f"{at}: {fn['name']!r} is in namespace {t['name']!r} twice", at)
        out.namespaces[name] = (t["name"], fn["name"])
        if kind == "custom":
            out.custom.add(name)
        out.tools.append(tool)


def offered(body: dict[str, Any]) -> Offered:
    out = Offered()
    tools = body.get("tools")
    if tools is None:
        return out
    serving.need(isinstance(tools, list), "'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            out.tools.append(_function(t, where))
        elif kind == "custom":
            out.tools.append(_custom(t, where))
            out.custom.add(t["name"])
        elif kind == "namespace":
            _namespace(t, where, out)
        elif kind in HOSTED:
            out.left_out.append(kind)
            continue
        else:
            serving.need(False, f"{where}.type {kind!r} is not supported by this server (function, custom and "
                         f"namespace tools are; hosted tools are left out)", f"{where}.type")
        out.echo.append(t)
    names = [t["function"]["name"] for t in out.tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    serving.need(dup is None, f"two tools are named {dup!r}", "tools")
    return out


def tool_choice(body: dict[str, Any], oai: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        serving.need(isinstance(choice.get("name"), str), "tool_choice of type 'function' needs a name",
                     "tool_choice.name")
        oai["tool_choice"] = {"type": "function", "function": {"name": flat(choice.get("namespace"), choice["name"])}}
    elif choice is not None:
        serving.need(choice in ("auto", "none", "required"),
                     "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                     "tool_choice")
        oai["tool_choice"] = choice
