"""How a request asks for reasoning, in every dialect: OpenAI's `reasoning_effort` (and the
Responses API's `reasoning.effort`) as the template variables llama-server sets, and
llama-server's `reasoning_format`."""
from __future__ import annotations

from typing import Any

from appliance.errors import InvalidRequest

# none and minimal turn a template's thinking off, the rest on; low, medium and high also reach
# templates that read `reasoning_effort` (gpt-oss)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
THINKING_OFF = ("none", "minimal")
TEMPLATE_EFFORTS = ("low", "medium", "high")
REASONING_FORMATS = ("none", "deepseek", "auto")   # llama-server's --reasoning-format


def reasoning_kwargs(effort: Any, param: str) -> dict[str, Any]:
    """The template variables a reasoning effort sets (none given: the template's default)."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise InvalidRequest(f"'{param}' must be one of {', '.join(EFFORTS)}", param=param)
    kwargs: dict[str, Any] = {"enable_thinking": effort not in THINKING_OFF}
    if effort in TEMPLATE_EFFORTS:
        kwargs["reasoning_effort"] = effort
    return kwargs


def reasoning_format(body: dict[str, Any]) -> str | None:
    """llama-server's per-request `reasoning_format` (None: the server's --reasoning-format)."""
    value = body.get("reasoning_format")
    if value is not None and value not in REASONING_FORMATS:
        raise InvalidRequest(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}",
                             param="reasoning_format")
    return value
