"""The toy MCP server on streamable HTTP, shared by the module that asks for it."""
from __future__ import annotations

import pytest

from .toy import free_port, toy_http


@pytest.fixture(scope="module")
def toy_http_url():
    """http://127.0.0.1:PORT/mcp of a toy server in a process of its own, until the module ends."""
    with toy_http(free_port()) as url:
        yield url
