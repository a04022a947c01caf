"""The Origin rule, on every route: which web pages may use this server.

Every body is read as JSON whatever its Content-Type (Ollama's documented `curl -d` sends a form
type, litellm's `ollama_chat/` none), so a content type no longer tells a page's request from a
script's. A browser names the page behind a request in its `Origin` header, and a page of
another site can send a POST the browser does not ask about first (a form, or fetch with a form
or text body): the server refuses it itself, by that header, as Ollama does (OLLAMA_ORIGINS
over gin-contrib/cors, read in envconfig/config.go and server/routes.go):

- no Origin (curl, the SDKs, scripts): allowed;
- the page's own origin, `http(s)://` + the request's Host: the chat pages this server serves,
  under whatever name or address the browser reached it (the listen address cannot say that:
  0.0.0.0 is no origin, and a proxy or a LAN name is not the bound address);
- pages from this machine (http(s)://localhost, 127.0.0.1, 0.0.0.0 or [::1], any port), desktop
  apps' origins (app://, file://, tauri://, vscode-webview://, vscode-file://) and browser
  extensions': Ollama's defaults;
- `--cors-origins`: a comma-separated list, each an origin, `*` (any), or an origin with one
  `*` in it (`https://*.example.com`);
- any other Origin: 403 in the route's API's error shape, whatever the method or content type.

DNS rebinding (a page on evil.com whose name is made to resolve to 127.0.0.1) sends Host
evil.com and Origin http://evil.com, which the own-origin rule would take for the chat page: on
a server bound to loopback only, the Host check (web/__init__.py) refuses a Host that is not
local before this rule runs. On a server bound to a network address there is no Host check, and
a rebound page is its own origin to the browser too (it could send JSON before this rule as
well): --api-key is what guards such a server.
"""
from __future__ import annotations

import re

# Ollama's default origins: this machine's pages on any port, desktop apps, browser extensions
LOCAL = re.compile(r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(:\d{1,5})?")
APP_SCHEMES = ("app://", "file://", "tauri://", "vscode-webview://", "vscode-file://",
               "chrome-extension://", "moz-extension://", "safari-extension://", "ms-browser-extension://")


def allowed(origin: str, host: str, listed: str) -> bool:
    """Whether a request with this Origin, to this Host, may be served (`listed`: --cors-origins)."""
    origin, host = origin.strip().lower(), host.strip().lower()
    if host and origin in (f"http://{host}", f"https://{host}"):
        return True
    if LOCAL.fullmatch(origin) or origin.startswith(APP_SCHEMES):
        return True
    return any(_matches(origin, entry) for entry in entries(listed))


def entries(listed: str) -> list[str]:
    """--cors-origins' entries, lower-cased, without a trailing slash."""
    return [e.strip().lower().rstrip("/") for e in listed.split(",") if e.strip()]


def _matches(origin: str, entry: str) -> bool:
    if entry == "*":
        return True
    head, star, tail = entry.partition("*")
    if not star:
        return origin == entry
    return len(origin) >= len(head) + len(tail) and origin.startswith(head) and origin.endswith(tail)
