"""/openapi.json against the app it describes: every route but the pages and their static files
is documented, with each of its methods, and nothing is documented that the app does not serve.
(What the routes answer is held to the document by test_openapi_fuzz.py.)"""
from __future__ import annotations

import re

import pytest

from appliance.config import Config, ServerConfig
from web import create_app, openapi
from web import openapi_apis


def _key(path: str) -> str:
    """A path with its variables unnamed: Flask's <path:model_id> and OpenAPI's {model} alike."""
    return re.sub(r"<[^>]+>|\{[^}]+\}", "{}", path)


class NoModels:
    """A pool with nothing loaded: the routes are registered, none is called."""

    def client(self, name=None):
        return None

    def engine_pids(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> set[tuple[str, str]]:
    db = tmp_path_factory.mktemp("routes") / "conversations.db"
    app = create_app(Config(server=ServerConfig(conversations_db=str(db))), NoModels())
    return {(_key(rule.rule), method.lower()) for rule in app.url_map.iter_rules()
            if not (rule.endpoint == "static" or rule.endpoint.startswith("ui."))
            for method in rule.methods - {"HEAD", "OPTIONS"}}


@pytest.fixture(scope="module")
def documented() -> set[tuple[str, str]]:
    doc = openapi_apis.build("m", 256, n_vocab=1000)
    return {(_key(path), method) for path, ops in doc["paths"].items() for method in ops}


def test_every_api_route_and_method_is_documented(served, documented):
    assert sorted(served - documented) == []


def test_nothing_is_documented_that_the_app_does_not_serve(served, documented):
    assert sorted(documented - served) == []


def test_each_api_documents_errors_in_its_own_shape():
    paths = openapi_apis.build("m", 256, n_vocab=1000)["paths"]

    def error(path: str, method: str = "post") -> dict:
        return paths[path][method]["responses"]["400"]["content"]["application/json"]["schema"]

    assert error("/v1/messages")["required"] == ["type", "error"]
    assert error("/api/chat")["properties"] == {"error": {"type": "string"}}
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/completion"):
        assert error(path)["properties"]["error"]["required"] == ["message", "type"]
